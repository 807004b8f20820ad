"""Whole-buffer file I/O at a block file's payload offset, and the open flags
every disk-tier file is opened with.

Regular files rarely read or write short, but NFS and FUSE may; these loops
make a short transfer either complete or visible (a read shorter than asked
means the file shrank, which the caller treats as corruption).
"""
from __future__ import annotations

import errno
import os

from .header import HEADER_BYTES

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# A block file is ours only if it is a regular file, never a symlink.
RDONLY = os.O_RDONLY | CLOEXEC | NOFOLLOW


def write_all(fd: int, bufs: list[memoryview]) -> None:
    """pwritev until every byte is written (regular files rarely write short)."""
    off = 0
    bufs = [b for b in bufs if b.nbytes]
    while bufs:
        n = os.pwritev(fd, bufs, off)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        off += n
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]


def pread_all(fd: int, n: int) -> bytes:
    """The payload's first n bytes (fewer at EOF)."""
    data = os.pread(fd, n, HEADER_BYTES)
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = os.pread(fd, n - got, HEADER_BYTES + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def preadv_all(fd: int, dst: memoryview) -> int:
    """Fill dst from the payload; returns the bytes read (< nbytes at EOF)."""
    got = 0
    n = dst.nbytes
    while got < n:
        k = os.preadv(fd, [dst[got:]], HEADER_BYTES + got)
        if k <= 0:
            break
        got += k
    return got


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
