"""One mapping of the arena file, shared by the daemon and its same-host clients.

The daemon's host tier (kvkeeper.server.tiers.arena.Arena: creates the file,
lays blocks out on its pages, unlinks it at shutdown) and a client's mapping
of it (kvkeeper.client.shm.ShmMapping: attaches to the file the daemon
announced) both map the whole file MAP_SHARED and move block bytes through
the same views and copies, with the same bounds checks: only the data region
[data_offset, size_bytes) is ever handed out, so no caller can clobber the
header another process reads.

Copies use memoryview slice assignment between flat byte views, which CPython
performs as a single memmove per extent: no intermediate bytes objects, and
as fast as numpy.copyto for 256 KiB..4 MiB blocks (slightly faster per call).
The one exception is a source/destination distance that makes glibc's memmove
crawl on AMD CPUs; see arena_format.copy_bytes.

Closing while views handed out (`view`, `gather`) are still alive cannot unmap
without invalidating them: the mapping is then unmapped when the last of them
is dropped, while this object refuses further use.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from typing import Any, Iterable, Optional, Sequence

import numpy as np

from .arena_format import (HEADER_STRUCT, Extent, Update, byte_view, copy_run, extents_in,
                           gather_into, parse_header, scatter_from)

__all__ = ["ArenaMapping", "POPULATE_STEP", "file_id", "map_file", "populate"]


def map_file(fd: int, size_bytes: int) -> mmap.mmap:
    """A shared read-write mapping of the first `size_bytes` of the open file `fd`."""
    return mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)


# madvise(MADV_POPULATE_READ), Linux 5.14+ (Python 3.11's mmap has no name for it).
MADV_POPULATE_READ = getattr(mmap, "MADV_POPULATE_READ", 22)
# Populated this much at a time: each madvise holds the GIL while it runs.
POPULATE_STEP = 64 << 20


def populate(mm: mmap.mmap, fd: int, lo: int, hi: int) -> int:
    """Map into `mm` now the pages of [lo, hi) of the file `fd` that hold data,
    so that the first copy touching each does not page-fault; holes (pages
    never written) are skipped, as populating them would allocate them.
    Returns the bytes populated; 0 where the kernel cannot (before 5.14, or
    no SEEK_DATA), which only leaves the faults to the first copies."""
    done = 0
    pos = lo
    try:
        while pos < hi:
            try:
                start = os.lseek(fd, pos, os.SEEK_DATA)
            except OSError:   # ENXIO: no data past pos
                break
            if start >= hi:
                break
            end = min(os.lseek(fd, start, os.SEEK_HOLE), hi)
            start -= start % mmap.PAGESIZE
            while start < end:
                n = min(POPULATE_STEP, end - start)
                mm.madvise(MADV_POPULATE_READ, start, n)
                done += n
                start += n
            pos = end
    except (OSError, ValueError, AttributeError):
        pass   # unsupported here: the first copies fault instead
    return done


def file_id(st: os.stat_result) -> tuple[int, int]:
    """What identifies a file across paths: another file at the same path has another."""
    return st.st_dev, st.st_ino


class ArenaMapping:
    """A mapping of an arena file: its header's fields, views of its data
    region, block copies in and out, and its lifetime."""

    __slots__ = ("_path", "_size", "_arena_id", "_page_bytes", "_page_count", "_data_offset",
                 "_file_id", "_mm", "_mv", "_base", "_arr", "_closed")

    def __init__(self, path: str, size_bytes: int, arena_id: bytes, page_bytes: int,
                 page_count: int, data_offset: int, fid: tuple[int, int],
                 mm: mmap.mmap) -> None:
        self._path = path
        self._size = size_bytes
        self._arena_id = arena_id
        self._page_bytes = page_bytes
        self._page_count = page_count
        self._data_offset = data_offset
        self._file_id = fid  # (st_dev, st_ino) of the file mapped
        self._mm: mmap.mmap | None = mm
        self._mv: memoryview | None = memoryview(mm)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mm))  # export dropped at once
        self._arr: np.ndarray | None = None   # the mapping as uint8, made on first use
        self._closed = False

    # ---- properties

    @property
    def path(self) -> str:
        return self._path

    @property
    def size_bytes(self) -> int:
        return self._size

    @property
    def arena_id(self) -> bytes:
        return self._arena_id

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    @property
    def page_count(self) -> int:
        return self._page_count

    @property
    def data_offset(self) -> int:
        return self._data_offset

    @property
    def closed(self) -> bool:
        return self._closed

    def is_mapped_file(self, st: os.stat_result) -> bool:
        """Whether `st` describes the file this object maps (not one that replaced it)."""
        return file_id(st) == self._file_id

    def still_valid(self) -> bool:
        """Whether the file at `path` is still the arena this mapping shows.

        A restarted daemon unlinks the old file and creates a new one with a new
        id; the old mapping stays readable but is no longer shared with anyone,
        so this looks at the file under `path`, not only at the mapping."""
        mv = self._mv
        if mv is None:
            return False
        head = parse_header(mv)
        if head is None or head[0] != self._arena_id:
            return False
        try:
            fd = os.open(self._path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (OSError, ValueError):
            return False
        try:
            st = os.fstat(fd)
            if not self.is_mapped_file(st) or st.st_size != self._size:
                return False
            head = parse_header(os.pread(fd, HEADER_STRUCT.size, 0))
        except OSError:
            return False
        finally:
            os.close(fd)
        return head is not None and head[0] == self._arena_id

    # ---- access

    def _checked(self, extents: Iterable[Any]) -> tuple[memoryview, list[Extent], int]:
        """The live view, the extents normalized and checked to lie in the
        data region, and their total length."""
        mv = self._mv
        if mv is None:
            raise ValueError(f"{type(self).__name__} is closed")
        ext, total = extents_in(extents, self._data_offset, self._size)
        return mv, ext, total

    def view(self, offset: int, length: int) -> memoryview:
        """A zero-copy writable view of [offset, offset + length) of the data region.
        While any such view is alive, `close` cannot unmap (see there)."""
        mv, ((off, n),), _ = self._checked([(offset, length)])
        return mv[off:off + n]

    def gather(self, extents: Sequence[Any]) -> list[memoryview]:
        """Zero-copy writable views of the extents, in order (see `view`)."""
        mv, ext, _ = self._checked(extents)
        return [mv[off:off + n] for off, n in ext]

    def gather_readonly(self, blocks: Sequence[Sequence[Extent]]) -> list[list[memoryview]]:
        """`gather` of each block's extents, as read-only views, in one pass:
        `blocks` as plain (offset, length) int tuples (copies.extents_of).
        The connector's loads take 64-128 blocks a step, where gather's
        per-extent normalization and a toreadonly() per view cost ~9 us a
        block; here each view is a slice of one read-only view."""
        mv = self._mv
        if mv is None:
            raise ValueError(f"{type(self).__name__} is closed")
        lo, hi = self._data_offset, self._size
        ro = mv.toreadonly()
        out = []
        for ext in blocks:
            views = []
            for off, n in ext:
                if n < 0 or off < lo or off + n > hi:
                    raise ValueError(f"extent ({off}, {n}) is outside the data region "
                                     f"[{lo}, {hi})")
                views.append(ro[off:off + n])
            out.append(views)
        return out

    def read(self, extents: Sequence[Any]) -> bytes:
        """The block's bytes (the concatenation of its extents), copied once."""
        mv, ext, _ = self._checked(extents)
        if len(ext) == 1:
            off, n = ext[0]
            return mv[off:off + n].tobytes()
        return b"".join([mv[off:off + n] for off, n in ext])

    def read_into(self, extents: Sequence[Any], out: Any) -> None:
        """Copy the block's bytes into `out`: any writable C-contiguous buffer
        (bytearray, numpy array, tensor.numpy()) of exactly the block's size."""
        mv, ext, total = self._checked(extents)
        gather_into(mv, self._base, ext, total, out)

    def _array(self) -> np.ndarray:
        arr = self._arr
        if arr is None:
            if self._mm is None:
                raise ValueError(f"{type(self).__name__} is closed")
            arr = self._arr = np.frombuffer(self._mm, dtype=np.uint8)
        return arr

    def read_block(self, ext: list[Extent], out: np.ndarray,
                   update: Optional[Update] = None) -> None:
        """Copy a whole block out: `ext` as plain (offset, length) tuples,
        `out` a flat writable uint8 array of exactly the block's size; with
        `update`, feed it the bytes copied into `out`, piece by piece while
        each is in cache. The lean path of batches (kvkeeper.client.copies):
        arena_format.copy_run, with read_into's bounds checks."""
        copy_run(self._array(), self._base, self._data_offset, self._size, ext, out, False,
                 update)

    def write_block(self, ext: list[Extent], data: np.ndarray,
                    update: Optional[Update] = None) -> None:
        """Copy a whole block in (see read_block): `data` a flat uint8 array of
        exactly the block's size; `update` is fed the bytes of `data`."""
        copy_run(self._array(), self._base, self._data_offset, self._size, ext, data, True,
                 update)

    def write(self, extents: Sequence[Any], data: Any, start: int = 0, *,
              whole: bool = False) -> None:
        """Copy `data` (any C-contiguous bytes-like object) into the block's
        bytes beginning at byte `start` within the block (the concatenation of
        its extents); may cross extents. whole=True: `data` must be the whole
        block, exactly as long as the extents."""
        mv, ext, total = self._checked(extents)
        if whole:
            n = byte_view(data, writable=False).nbytes
            if n != total or start:
                raise ValueError(f"data holds {n} bytes but the extents hold {total}")
        scatter_from(mv, self._base, ext, total, data, start)

    # ---- lifetime

    def close(self) -> None:
        """Unmap. Idempotent. The file stays (see Arena.close for the owner's)."""
        if self._closed:
            return
        self._closed = True
        mv, mm = self._mv, self._mm
        self._mv = None
        self._mm = None
        self._arr = None   # a copy still running elsewhere keeps its own reference
        if mv is not None:
            mv.release()
        if mm is not None:
            try:
                mm.close()
            except BufferError:
                pass  # views are alive: the mmap closes when the last is dropped

    def __enter__(self) -> "ArenaMapping":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"{type(self).__name__}({self._path!r}, size_bytes={self._size}, "
                f"page_bytes={self._page_bytes}, page_count={self._page_count}, {state})")

