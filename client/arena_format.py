"""The arena's on-file layout and the byte-copy primitives, shared by the
daemon (kvkeeper.server.tiers.arena) and its same-host clients
(kvkeeper.client.shm), through kvkeeper.client.arena_mapping, so that both
sides agree on one definition.
Imports nothing from kvkeeper.server.
"""
from __future__ import annotations

import ctypes
import os
import struct
from operator import index as _index
from typing import Any, Callable, Iterable, Optional

import numpy as np

MAGIC = b"KVKARENA"
ARENA_ID_BYTES = 16
HEADER_BYTES = 4096
# Pages are whole multiples of the OS page, so every page maps and faults alone.
PAGE_ALIGN = 4096
FORMAT_VERSION = 1
# magic, arena_id, page_bytes, page_count, data_offset, version
HEADER_STRUCT = struct.Struct("<8s16sQQQQ")

Extent = tuple[int, int]


def write_header(buf: Any, arena_id: bytes, page_bytes: int, page_count: int) -> None:
    """Write a v1 header, with the data region right after it, at the start of `buf`."""
    HEADER_STRUCT.pack_into(buf, 0, MAGIC, arena_id, page_bytes, page_count, HEADER_BYTES,
                            FORMAT_VERSION)


def parse_header(buf: Any) -> Optional[tuple[bytes, int, int, int]]:
    """(arena_id, page_bytes, page_count, data_offset), or None if not a v1 arena."""
    try:
        magic, arena_id, page_bytes, page_count, data_offset, version = \
            HEADER_STRUCT.unpack_from(buf, 0)
    except struct.error:
        return None
    if magic != MAGIC or version != FORMAT_VERSION:
        return None
    return arena_id, page_bytes, page_count, data_offset


def extents_in(extents: Iterable[Any], lo: int, hi: int) -> tuple[list[Extent], int]:
    """Normalize extents, (offset, length) tuples or objects with .offset/.length
    (protobuf Extent), check that each lies in [lo, hi), and add up their lengths."""
    out: list[Extent] = []
    total = 0
    for e in extents:
        if isinstance(e, (tuple, list)):
            off, length = e
        else:
            off, length = e.offset, e.length
        off, length = _index(off), _index(length)
        if length < 0 or off < lo or off + length > hi:
            raise ValueError(f"extent ({off}, {length}) is outside the data region [{lo}, {hi})")
        out.append((off, length))
        total += length
    return out, total


def byte_view(obj: Any, writable: bool = False) -> memoryview:
    """A flat unsigned-byte view of any C-contiguous buffer, without copying."""
    try:
        mv = memoryview(obj)
    except TypeError:
        raise ValueError(f"expected a bytes-like buffer, got {type(obj).__name__}") from None
    if writable and mv.readonly:
        raise ValueError("the destination buffer is read-only")
    if not mv.c_contiguous:
        raise ValueError("the buffer must be C-contiguous")
    if mv.format == "B" and mv.ndim == 1:
        return mv
    try:
        return mv.cast("B")
    except TypeError:
        # A format memoryview.cast refuses (e.g. '>f' or a struct): numpy
        # reinterprets any contiguous buffer as bytes.
        return memoryview(np.frombuffer(mv, dtype=np.uint8))


# glibc's memmove copies mid-sized runs (from ~2 KiB up to a stop threshold,
# the L2 size on AMD in glibc 2.33-2.38) with `rep movsb`, which on AMD Zen
# crawls at ~2 GB/s instead of ~30 when the destination lies 1..31 bytes past
# the source modulo 4 KiB (page aliasing; glibc bug 30994). Arena pages are
# page-aligned and a large numpy array or bytearray starts 16 bytes into its
# page, so reading a 256 KiB extent into one hits exactly that. For those
# distances and sizes the copy runs as a numpy ufunc loop instead: still one
# pass with no intermediate buffer, ~20 GB/s. Elsewhere memmove is faster.
_ALIAS_WINDOW = 64
_ALIAS_MIN_BYTES = 2048


def _l2_cache_bytes() -> int:
    base = "/sys/devices/system/cpu/cpu0/cache"
    try:
        for name in sorted(os.listdir(base)):
            if not name.startswith("index"):
                continue
            with open(f"{base}/{name}/level") as f:
                if f.read().strip() != "2":
                    continue
            with open(f"{base}/{name}/size") as f:
                size = f.read().strip()
            unit = {"K": 1 << 10, "M": 1 << 20}.get(size[-1:], 1)
            value = int(size.rstrip("KM")) * unit
            if value > 0:
                return value
    except (OSError, ValueError):
        pass
    return 1 << 62  # unknown: always avoid the slow case


_ALIAS_MAX_BYTES = _l2_cache_bytes()


_BYTES_DATA_OFFSET = bytes.__basicsize__ - 1  # CPython: where a bytes object's data starts


def address(mv: memoryview) -> int:
    """Address of the first byte of a non-empty flat byte view. Only picks the
    copy path in `_copy`, so a wrong answer costs speed, never correctness."""
    if not mv.readonly:
        return ctypes.addressof(ctypes.c_char.from_buffer(mv))
    obj = mv.obj
    if type(obj) is bytes and len(obj) == mv.nbytes:  # the common read-only case, cheaply
        return id(obj) + _BYTES_DATA_OFFSET
    return np.frombuffer(mv, dtype=np.uint8).ctypes.data


def copy_bytes(dst: memoryview, dst_addr: int, src: memoryview, src_addr: int) -> None:
    """dst[:] = src for equal-sized flat byte views: one memmove, or one ufunc
    pass where memmove would hit page aliasing (see above)."""
    if (_ALIAS_MIN_BYTES <= src.nbytes < _ALIAS_MAX_BYTES
            and 0 < (dst_addr - src_addr) % 4096 < _ALIAS_WINDOW):
        np.positive(np.frombuffer(src, dtype=np.uint8), out=np.frombuffer(dst, dtype=np.uint8))
    else:
        dst[:] = src


def gather_into(mv: memoryview, base: int, ext: list[Extent], total: int, out: Any) -> None:
    """Copy a block's extents of the mapping `mv` (whose first byte is at
    address `base`) into `out`, a writable buffer of exactly `total` bytes."""
    dst = byte_view(out, writable=True)
    if dst.nbytes != total:
        raise ValueError(f"out holds {dst.nbytes} bytes but the extents hold {total}")
    if total == 0:
        return
    dst_addr, pos = address(dst), 0
    for off, length in ext:
        copy_bytes(dst[pos:pos + length], dst_addr + pos, mv[off:off + length], base + off)
        pos += length


def scatter_from(mv: memoryview, base: int, ext: list[Extent], total: int, data: Any,
                 start: int = 0) -> None:
    """Copy `data` into a block's extents of the mapping `mv` (first byte at
    address `base`), beginning at byte `start` of the block (the
    concatenation of its `total` bytes of extents); may cross extents."""
    src = byte_view(data, writable=False)
    n = src.nbytes
    if start < 0 or start + n > total:
        raise ValueError(f"writing {n} bytes at {start} overruns a block of {total} bytes")
    if n == 0:
        return
    src_addr = address(src)
    pos = 0   # block position of the current extent's first byte
    done = 0  # bytes of src copied
    for off, length in ext:
        if done == n:
            break
        end = pos + length
        if end > start:
            skip = max(start + done - pos, 0)
            take = min(length - skip, n - done)
            copy_bytes(mv[off + skip:off + skip + take], base + off + skip,
                       src[done:done + take], src_addr + done)
            done += take
        pos = end



# A batch copy (`copy_run`) moves a block in pieces of at most this size and
# feeds each piece to the block's checksum right after copying it, while it
# is still in cache (a piece's source and destination together fit the L2
# cache), rather than reading the whole block from memory a second time.
PIECE_BYTES = 256 << 10

Update = Callable[[Any], Any]
"""A running checksum's update, fed the pieces of a block in order."""


def copy_run(arena: np.ndarray, base: int, lo: int, hi: int, ext: list[Extent],
             block: np.ndarray, into_arena: bool, update: Optional[Update]) -> None:
    """Copy a whole block between `block` (a flat uint8 array of exactly the
    block's size) and its extents `ext` of `arena` (the mapping as a flat
    uint8 array whose first byte is at address `base`; each extent must lie
    in [lo, hi)), into the arena or out of it. With `update`, feed it the block's bytes piece by piece as they
    are copied: the destination's on the way out (what a reader gets is
    what gets checked), the source's on the way in (what a writer gave).

    Each piece is one np.copyto (a memmove: 0.77x memcpy with XXH3-64 fused
    in `kvkeeper bench data`, against 0.70x through a ufunc loop), or one
    ufunc pass (np.positive) where the source/destination distance would
    make memmove crawl (above): the mapping's address is the caller's and
    the block's is taken once, so the check is integer arithmetic per piece. Both drop the GIL
    (the event loop runs meanwhile). The lean path of batches
    (kvkeeper.client.copies): ~3 us per block of Python instead of ~8
    through gather_into/scatter_from."""
    pos, size = 0, block.shape[0]
    # (destination - source) of the block's first byte at arena offset 0.
    skew = (base - block.ctypes.data) * (1 if into_arena else -1)
    for off, n in ext:
        end = pos + n
        if off < lo or n <= 0 or off + n > hi or end > size:
            raise ValueError(f"extent ({off}, {n}) is outside the data region [{lo}, {hi}) "
                             f"or past the block's {size} bytes")
        step = PIECE_BYTES if update is not None else n   # pieces only serve the hash
        shift = (skew + (off - pos if into_arena else pos - off)) % 4096
        crawls = 0 < shift < _ALIAS_WINDOW
        for p in range(0, n, step):
            q = min(p + step, n)
            a, b = arena[off + p:off + q], block[pos + p:pos + q]
            src, dst = (b, a) if into_arena else (a, b)
            if crawls and _ALIAS_MIN_BYTES <= q - p < _ALIAS_MAX_BYTES:
                np.positive(src, out=dst)
            else:
                np.copyto(dst, src)
            if update is not None:
                update(b)
        pos = end
    if pos != size:
        raise ValueError(f"the extents hold {pos} bytes but the block {size}")
