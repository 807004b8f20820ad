"""Client mapping of the daemon's host-tier arena (a file under /dev/shm).

A client on the same host as the daemon maps the arena named in
RegisterSessionResponse.arena and copies block bytes in and out itself, one
memcpy per extent; the daemon only hands out extents (file offset, length).
`ShmMapping.attach` returns None when the file is not there, has another
size, or shows another arena id: the client is on another host, or the daemon
restarted, and must stream instead.

The header layout (see kvkeeper.server.tiers.arena, which this module must not
import):

    0: magic b"KVKARENA" | 8: arena_id (16 bytes) | 24: page_bytes u64 |
    32: page_count u64 | 40: data_offset u64 | 48: version u64   (little-endian)

Copies use memoryview slice assignment between flat byte views, which CPython
performs as a single memmove per extent: no intermediate bytes objects, and
as fast as numpy.copyto for 256 KiB..4 MiB blocks (slightly faster per call).
The one exception is a source/destination distance that makes glibc's memmove
crawl on AMD CPUs; see `_copy`.
"""
from __future__ import annotations

import ctypes
import mmap
import os
import struct
from typing import Any, Iterable, Optional, Sequence


from .arena_format import (ARENA_ID_BYTES, FORMAT_VERSION, HEADER_BYTES, HEADER_STRUCT, MAGIC, unmap,
                           Extent, byte_view, extents_in, gather_into, scatter_from)


def _parse_header(buf: Any) -> Optional[tuple[bytes, int, int, int]]:
    """(arena_id, page_bytes, page_count, data_offset), or None if not a v1 arena."""
    try:
        magic, arena_id, page_bytes, page_count, data_offset, version = \
            HEADER_STRUCT.unpack_from(buf, 0)
    except struct.error:
        return None
    if magic != MAGIC or version != FORMAT_VERSION:
        return None
    return arena_id, page_bytes, page_count, data_offset


class ShmMapping:
    """A client's read-write mapping of the arena. Create with `attach`."""

    __slots__ = ("_path", "_size", "_arena_id", "_page_bytes", "_page_count", "_data_offset",
                 "_file_id", "_mm", "_mv", "_base", "_closed")

    def __init__(self, path: str, size_bytes: int, arena_id: bytes, page_bytes: int,
                 page_count: int, data_offset: int, file_id: tuple[int, int],
                 mm: mmap.mmap) -> None:
        self._path = path
        self._size = size_bytes
        self._arena_id = arena_id
        self._page_bytes = page_bytes
        self._page_count = page_count
        self._data_offset = data_offset
        self._file_id = file_id
        self._mm: mmap.mmap | None = mm
        self._mv: memoryview | None = memoryview(mm)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mm))  # export dropped at once
        self._closed = False

    @classmethod
    def attach(cls, path: str, size_bytes: int, arena_id: bytes) -> Optional["ShmMapping"]:
        """Map the arena at `path` if it is the one the daemon described, else None.

        None means: no such file, another size, another id or not an arena
        (another host, or the daemon restarted), or no permission to map it.
        """
        try:
            size_bytes = int(size_bytes)
            arena_id = bytes(memoryview(arena_id))
        except (TypeError, ValueError):
            return None
        if size_bytes < HEADER_BYTES or len(arena_id) != ARENA_ID_BYTES:
            return None
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except (OSError, ValueError):  # missing, no permission, bad path
            return None
        try:
            st = os.fstat(fd)
            if st.st_size != size_bytes:
                return None
            # Check the id before mapping, with the same fd so it is the same file.
            head = _parse_header(os.pread(fd, HEADER_STRUCT.size, 0))
            if head is None or head[0] != arena_id:
                return None
            mm = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        _, page_bytes, page_count, data_offset = head
        if not (HEADER_BYTES <= data_offset <= size_bytes):
            mm.close()
            return None
        return cls(path, size_bytes, arena_id, page_bytes, page_count, data_offset,
                   (st.st_dev, st.st_ino), mm)

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

    def still_valid(self) -> bool:
        """Whether the file at `path` is still the arena this mapping shows.

        A restarted daemon unlinks the old file and creates a new one with a new
        id; the old mapping stays readable but is no longer shared with anyone,
        so this looks at the file under `path`, not only at the mapping."""
        mv = self._mv
        if mv is None:
            return False
        head = _parse_header(mv)
        if head is None or head[0] != self._arena_id:
            return False
        try:
            fd = os.open(self._path, os.O_RDONLY | getattr(os, "O_CLOEXEC", 0))
        except (OSError, ValueError):
            return False
        try:
            st = os.fstat(fd)
            if (st.st_dev, st.st_ino) != self._file_id or st.st_size != self._size:
                return False
            head = _parse_header(os.pread(fd, HEADER_STRUCT.size, 0))
        except OSError:
            return False
        finally:
            os.close(fd)
        return head is not None and head[0] == self._arena_id

    # ---- access

    def _check(self, extents: Iterable[Any]) -> tuple[memoryview, list[Extent], int]:
        mv = self._mv
        if mv is None:
            raise ValueError("shm mapping is closed")
        ext, total = extents_in(extents, self._data_offset, self._size)
        return mv, ext, total

    def read_into(self, extents: Sequence[Any], out: Any) -> None:
        """Copy the block's bytes into `out`: any writable C-contiguous buffer
        (bytearray, numpy array, tensor.numpy()) of exactly sum(lengths) bytes."""
        mv, ext, total = self._check(extents)
        gather_into(mv, self._base, ext, total, out)

    def read(self, extents: Sequence[Any]) -> bytes:
        """The block's bytes as one new bytes object (one copy)."""
        mv, ext, _ = self._check(extents)
        if len(ext) == 1:
            off, length = ext[0]
            return mv[off:off + length].tobytes()
        return b"".join([mv[off:off + length] for off, length in ext])

    def write(self, extents: Sequence[Any], data: Any) -> None:
        """Copy `data`, any C-contiguous bytes-like object of exactly sum(lengths)
        bytes, into the block's extents."""
        mv, ext, total = self._check(extents)
        n = byte_view(data, writable=False).nbytes
        if n != total:
            raise ValueError(f"data holds {n} bytes but the extents hold {total}")
        scatter_from(mv, self._base, ext, total, data)

    def gather(self, extents: Sequence[Any]) -> list[memoryview]:
        """Zero-copy writable views of the extents, in order. While any is alive,
        `close` cannot unmap (the mapping is then unmapped when they are dropped)."""
        mv, ext, _ = self._check(extents)
        return [mv[off:off + length] for off, length in ext]

    # ---- lifetime

    def close(self) -> None:
        """Unmap. Idempotent. The file stays: the daemon owns it."""
        if self._closed:
            return
        self._closed = True
        mv, mm = self._mv, self._mm
        self._mv = None
        self._mm = None
        unmap(mv, mm)

    def __enter__(self) -> "ShmMapping":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return f"ShmMapping({self._path!r}, size_bytes={self._size}, {state})"
