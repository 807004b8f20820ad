"""Whole-buffer file I/O at a block file's payload offset, and the open flags
every disk-tier file is opened with.

Regular files rarely read or write short, but NFS and FUSE may; these loops
make a short transfer either complete or visible (a read shorter than asked
means the file shrank, which the caller treats as corruption).

`read_block` is a block load's whole file I/O: a preadv of header, payload
and one byte past the end (that byte tells a file longer than its header
says without an fstat), and the payload's checksum. Syscalls cost 1-3 us
each, a 256 KiB block's copy ~30-60 us: the pread of the header and the
fstat that loads did before were ~10%. A payload of more than PIECED_ABOVE
is read in pieces of PIECE_BYTES, each hashed (client.checksum.Hasher) right
after it lands, while it is still in the core's cache: hashed after one
whole read, a 4 MiB block is read back from memory. The payload may also go
to a list of buffers (a scatter read): a promotion reads straight into the
block's arena pages when they are not one run, where a bounce buffer cost an
allocation and a second copy of every byte.
"""
from __future__ import annotations

import errno
import os
import threading
import zlib
from typing import Iterator, Union

import xxhash

from kvkeeper.client.checksum import ALGOS, Hasher, checksum_parts

from .header import (CHECKSUM_CRC32, CHECKSUM_XXH3_64, HEADER_BYTES, HEADER_FIELDS_BYTES,
                     PAYLOAD_ALGOS, Header, parse_header)

CLOEXEC = getattr(os, "O_CLOEXEC", 0)
NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
# A block file is ours only if it is a regular file, never a symlink.
RDONLY = os.O_RDONLY | CLOEXEC | NOFOLLOW
# Buffers per preadv or pwritev, below Linux's IOV_MAX (1024; os refuses more).
IOV_MAX = 512


def write_all(fd: int, bufs: list[memoryview]) -> None:
    """pwritev until every byte is written (regular files rarely write short),
    at most IOV_MAX buffers a call."""
    off = 0
    bufs = [b for b in bufs if b.nbytes]
    while bufs:
        n = os.pwritev(fd, bufs[:IOV_MAX], off)
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
# A payload's destination: one buffer, or its pieces in order (read_block).
Buffers = Union[memoryview, list[memoryview]]
# Payloads larger than PIECED_ABOVE are read and hashed in pieces of
# PIECE_BYTES (see above). Measured with the disk pool's 4 threads on 2 cores
# (Xeon, 2 MiB L2), ratio to a bare read: 4 MiB blocks 0.70-0.76x in pieces
# against 0.67-0.69x whole; 1 MiB ones, still in the core's cache after one
# whole read, 0.63x in pieces against 0.67-0.73x whole, so they stay whole.
# One thread: 64 KiB pieces cost more in syscalls, 512 KiB ones fell out of
# the cache (4 MiB: 0.75x both, against 0.80x for 256 KiB).
PIECED_ABOVE = 1 << 20
PIECE_BYTES = 256 << 10


def read_block(fd: int, dst: Buffers) -> tuple[Header | None, int | None]:
    """Header and payload of a block file into `dst` (its payload's size, as
    the caller believes), and the payload's checksum: one preadv, or one per
    piece of a large payload. `dst` may be a list of buffers, the payload's
    pieces in order (a scatter read: straight into a block's extents).
    Returns the header (None if not a valid one) and, when the file is
    exactly the header plus the payload as the header says, the payload's
    checksum under the header's algorithm (else None). `dst` is written
    before the header is checked, so after a failed check its content is
    undefined."""
    bufs = _scratch.__dict__.get("bufs")
    if bufs is None:
        head = memoryview(bytearray(HEADER_BYTES))
        bufs = _scratch.bufs = (head, head[:HEADER_FIELDS_BYTES], memoryview(bytearray(1)))
    head, fields, past_end = bufs
    parts = [dst] if type(dst) is memoryview else list(dst)
    n = sum(p.nbytes for p in parts)
    if n > PIECED_ABOVE or len(parts) > IOV_MAX:
        return _read_pieces(fd, parts, n, head, fields, past_end)
    want = HEADER_BYTES + n
    got = _fill(fd, [head, *parts, past_end], 0, want)
    h = parse_header(fields) if got >= HEADER_FIELDS_BYTES else None
    if h is None or h.payload_bytes != n or got != want:
        return h, None
    if len(parts) == 1:
        return h, _DIGEST[h.algo](parts[0])
    return h, checksum_parts(h.algo, parts)


def _pieces(parts: list[memoryview]) -> Iterator[list[memoryview]]:
    """`parts` regrouped in pieces of PIECE_BYTES (the last may be shorter),
    each at most IOV_MAX buffers: a part larger than a piece is split, small
    ones are read together."""
    group: list[memoryview] = []
    size = 0
    for p in parts:
        off, n = 0, p.nbytes
        while off < n:
            take = min(PIECE_BYTES - size, n - off)
            group.append(p[off:off + take])
            size += take
            off += take
            if size == PIECE_BYTES or len(group) == IOV_MAX:
                yield group
                group, size = [], 0
    if group:
        yield group


def _read_pieces(fd: int, parts: list[memoryview], n: int, head: memoryview,
                 fields: memoryview, past_end: memoryview) -> tuple[Header | None, int | None]:
    """read_block of a payload of more than PIECED_ABOVE (or in more than
    IOV_MAX parts): the header with the first piece, then piece by piece,
    the last with the byte past the end; each piece is hashed as soon as it
    has landed."""
    pieces = _pieces(parts)
    first = next(pieces, [])
    size = sum(p.nbytes for p in first)
    bufs = [head, *first, past_end] if size >= n else [head, *first]
    got = _fill(fd, bufs, 0, HEADER_BYTES + size)
    h = parse_header(fields) if got >= HEADER_FIELDS_BYTES else None
    if h is None or h.payload_bytes != n or got != HEADER_BYTES + size:
        return h, None
    digest = Hasher(h.algo)
    for p in first:
        digest.feed(p)
    off = size
    for piece in pieces:
        size = sum(p.nbytes for p in piece)
        last = off + size >= n
        got = _fill(fd, [*piece, past_end] if last else piece, HEADER_BYTES + off, size)
        if got != size:
            return h, None
        for p in piece:
            digest.feed(p)
        off += size
    return h, digest.digest()


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
