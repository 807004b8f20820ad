"""Whole-buffer file I/O at a block file's payload offset, and the open flags
every disk-tier file is opened with.

Regular files rarely read or write short, but NFS and FUSE may; these loops
make a short transfer either complete or visible (a read shorter than asked
means the file shrank, which the caller treats as corruption).

`read_block` is a block load's whole file I/O: one preadv of header, payload
and one byte past the end (that byte tells a file longer than its header
says without an fstat), then the payload's checksum right after the copy.
Syscalls cost 1-3 us each here, a 256 KiB block's copy ~30-45 us: the pread
of the header and the fstat that loads did before were ~10%. Reading a large
block in 512 KiB pieces, each hashed while still in cache, measured no faster
here (1-4 MiB, side by side: 0.63-0.70x a bare read against 0.65-0.71x).
"""
from __future__ import annotations

import errno
import os
import threading
import zlib

import xxhash

from kvkeeper.client.checksum import ALGOS

from .header import (CHECKSUM_CRC32, CHECKSUM_XXH3_64, HEADER_BYTES, HEADER_FIELDS_BYTES,
                     PAYLOAD_ALGOS, Header, parse_header)

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


def readv_all(fd: int, bufs: list[memoryview], off: int) -> int:
    """preadv from `off` until every buffer is full or EOF; returns the bytes
    read (fewer than the buffers hold only at EOF). One syscall in the usual
    case: a regular file reads short only at its end."""
    want = sum(b.nbytes for b in bufs)
    got = os.preadv(fd, bufs, off)
    if got == want or got <= 0:
        return max(got, 0)
    total = got
    bufs = [b for b in bufs if b.nbytes]
    while True:
        while bufs and got >= bufs[0].nbytes:
            got -= bufs[0].nbytes
            bufs.pop(0)
        if not bufs:
            return total
        if got:
            bufs[0] = bufs[0][got:]
        got = os.preadv(fd, bufs, off + total)
        if got <= 0:
            return total
        total += got


# Each reader thread's header (whole, and its fields) and past-the-end
# buffers, reused across reads.
_scratch = threading.local()
# The payload checksums a header may name, called on the buffer directly (the
# same values as client.checksum's, minus its per-call argument checks).
_DIGEST = {CHECKSUM_XXH3_64: xxhash.xxh3_64_intdigest, CHECKSUM_CRC32: zlib.crc32}
assert set(_DIGEST) == set(PAYLOAD_ALGOS) <= set(ALGOS)


def read_block(fd: int, dst: memoryview) -> tuple[Header | None, int | None]:
    """Header and payload of a block file into `dst` (its payload's size, as
    the caller believes): one preadv, then the checksum. Returns the header
    (None if not a valid one) and, when the file is exactly the header plus
    `dst.nbytes` of payload as the header says, the payload's checksum under
    the header's algorithm (else None). `dst` is written before the header is
    checked, so after a failed check its content is undefined."""
    bufs = _scratch.__dict__.get("bufs")
    if bufs is None:
        head = memoryview(bytearray(HEADER_BYTES))
        bufs = _scratch.bufs = (head, head[:HEADER_FIELDS_BYTES], memoryview(bytearray(1)))
    head, fields, past_end = bufs
    n = dst.nbytes
    want = HEADER_BYTES + n
    got = _fill(fd, [head, dst, past_end], 0, want)
    h = parse_header(fields) if got >= HEADER_FIELDS_BYTES else None
    if h is None or h.payload_bytes != n or got != want:
        return h, None
    return h, _DIGEST[h.algo](dst)


def _fill(fd: int, bufs: list[memoryview], off: int, want: int) -> int:
    """One preadv, and readv_all only when it came back short of `want` (at
    EOF, or mid-file on NFS and FUSE); a past-the-end buffer in `bufs` is
    not part of `want`, so a file of the expected size costs one syscall."""
    got = os.preadv(fd, bufs, off)
    return got if got >= want else readv_all(fd, bufs, off)


def unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass
