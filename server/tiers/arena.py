"""Host tier: one shared-memory file that holds the pages of every host block.

The file (normally under /dev/shm) starts with a header of HEADER_BYTES:

    offset  size  field
    0       8     magic b"KVKARENA"
    8       16    arena_id, random per daemon start (os.urandom)
    24      8     page_bytes       (u64, little-endian)
    32      8     page_count       (u64)
    40      8     data_offset      (u64, = HEADER_BYTES)
    48      8     format version   (u64, = FORMAT_VERSION)

Page p occupies [data_offset + p * page_bytes, data_offset + (p + 1) * page_bytes).
A block's bytes are the concatenation of its extents, one per contiguous run of
its pages (see `Arena.extents`), the last one trimmed to the block's size.

Clients on the same host map the file themselves (kvkeeper.client.shm) and copy
block bytes in and out directly: the daemon never copies block bytes on the shm
path. The copy helpers here (`write`, `read`, `read_into`) serve the streaming
path, for clients that cannot map the file.

The file is created sparse (ftruncate) so pages are backed by memory only when
first touched.
"""
from __future__ import annotations

import ctypes
import mmap
import os
from operator import index as _index
from typing import Any, Iterable, Sequence


from ..ledger.pages import Pages, page_runs

from kvkeeper.client.arena_format import (ARENA_ID_BYTES, FORMAT_VERSION, HEADER_BYTES,
                                          HEADER_STRUCT, MAGIC, Extent, extents_in, gather_into,
                                          scatter_from, unmap)

PAGE_ALIGN = 4096


class Arena:
    """The daemon's mapping of the host-tier file. Create with `Arena.create`."""

    __slots__ = ("_path", "_size", "_page_bytes", "_page_count", "_arena_id", "_data_offset",
                 "_mm", "_mv", "_base", "_closed", "_file_id")

    def __init__(self, path: str, size_bytes: int, page_bytes: int, page_count: int,
                 arena_id: bytes, mm: mmap.mmap, file_id: tuple[int, int]) -> None:
        self._path = path
        self._size = size_bytes
        self._page_bytes = page_bytes
        self._page_count = page_count
        self._arena_id = arena_id
        self._data_offset = HEADER_BYTES
        self._mm: mmap.mmap | None = mm
        self._mv: memoryview | None = memoryview(mm)
        self._base = ctypes.addressof(ctypes.c_char.from_buffer(mm))  # export dropped at once
        self._closed = False
        self._file_id = file_id  # (st_dev, st_ino): close unlinks only this file

    @classmethod
    def create(cls, path: str, size_bytes: int, page_bytes: int) -> "Arena":
        """Create (or replace) the arena file at `path` and map it."""
        try:
            page_bytes, size_bytes = _index(page_bytes), _index(size_bytes)
        except TypeError:
            raise ValueError(f"page_bytes and size_bytes must be integers, got "
                             f"{page_bytes!r} and {size_bytes!r}") from None
        if page_bytes <= 0 or page_bytes % PAGE_ALIGN:
            raise ValueError(f"page_bytes must be a positive multiple of {PAGE_ALIGN}, "
                             f"got {page_bytes}")
        page_count = (size_bytes - HEADER_BYTES) // page_bytes if size_bytes > HEADER_BYTES else 0
        if page_count < 1:
            raise ValueError(f"size_bytes={size_bytes} holds no page: it needs at least "
                             f"{HEADER_BYTES} header bytes + {page_bytes} page bytes")
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | getattr(os, "O_CLOEXEC", 0) \
            | getattr(os, "O_NOFOLLOW", 0)
        fd = os.open(path, flags, 0o600)
        try:
            os.fchmod(fd, 0o600)  # whatever the umask
            st = os.fstat(fd)
            os.ftruncate(fd, size_bytes)
            mm = mmap.mmap(fd, size_bytes, flags=mmap.MAP_SHARED,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
        os.close(fd)  # mmap holds its own reference to the file
        arena_id = os.urandom(ARENA_ID_BYTES)
        HEADER_STRUCT.pack_into(mm, 0, MAGIC, arena_id, page_bytes, page_count, HEADER_BYTES,
                                FORMAT_VERSION)
        return cls(path, size_bytes, page_bytes, page_count, arena_id, mm, (st.st_dev, st.st_ino))

    # ---- properties

    @property
    def path(self) -> str:
        return self._path

    @property
    def size_bytes(self) -> int:
        return self._size

    @property
    def page_bytes(self) -> int:
        return self._page_bytes

    @property
    def page_count(self) -> int:
        return self._page_count

    @property
    def arena_id(self) -> bytes:
        return self._arena_id

    @property
    def data_offset(self) -> int:
        return self._data_offset

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- layout

    def extents(self, pages: Pages, n_pages: int, nbytes: int) -> list[Extent]:
        """(file offset, length) pieces covering the first `nbytes` of a block's
        pages, one per contiguous run, in block order; lengths add up to nbytes."""
        pb = self._page_bytes
        if n_pages <= 0:
            raise ValueError(f"a block has at least one page, got n_pages={n_pages}")
        if not isinstance(pages, int) and len(pages) != n_pages:
            raise ValueError(f"{len(pages)} pages given with n_pages={n_pages}")
        if nbytes < 0 or nbytes > n_pages * pb:
            raise ValueError(f"nbytes={nbytes} does not fit in {n_pages} pages of {pb} bytes")
        out: list[Extent] = []
        left = nbytes
        base = self._data_offset
        for first, count in page_runs(pages, n_pages):
            if first < 0 or first + count > self._page_count:
                raise ValueError(f"pages {first}..{first + count - 1} out of range "
                                 f"(page_count={self._page_count})")
            if left == 0:
                continue  # keep validating the remaining runs
            length = min(count * pb, left)
            out.append((base + first * pb, length))
            left -= length
        return out

    # ---- access

    def _live_view(self) -> memoryview:
        mv = self._mv
        if mv is None:
            raise ValueError("arena is closed")
        return mv

    def _check(self, extents: Iterable[Any]) -> tuple[list[Extent], int]:
        return extents_in(extents, self._data_offset, self._size)

    def view(self, offset: int, length: int) -> memoryview:
        """A zero-copy writable view of [offset, offset + length) of the data region.
        While any such view is alive, `close` cannot unmap (see there)."""
        ((off, length),), _ = self._check([(offset, length)])
        return self._live_view()[off:off + length]

    def write(self, extents: Sequence[Any], data: Any, start: int = 0) -> None:
        """Copy `data` into the block's bytes beginning at byte `start` within
        the block (the concatenation of its extents); may cross extents."""
        mv = self._live_view()
        ext, total = self._check(extents)
        scatter_from(mv, self._base, ext, total, data, start)

    def read_into(self, extents: Sequence[Any], out: Any) -> None:
        """Copy the block's bytes into `out`, a writable buffer of exactly the
        block's size."""
        mv = self._live_view()
        ext, total = self._check(extents)
        gather_into(mv, self._base, ext, total, out)

    def read(self, extents: Sequence[Any]) -> bytes:
        """The block's bytes, copied once."""
        mv = self._live_view()
        ext, _ = self._check(extents)
        if len(ext) == 1:
            off, length = ext[0]
            return mv[off:off + length].tobytes()
        return b"".join([mv[off:off + length] for off, length in ext])

    # ---- lifetime

    def close(self, unlink: bool = True) -> None:
        """Unmap and (by default) unlink the file. Idempotent.

        If views handed out by `view` are still alive the mapping cannot be
        unmapped without invalidating them; it is then left to be unmapped when
        the last of them is dropped, while this arena refuses further use."""
        if self._closed:
            return
        self._closed = True
        mv, mm = self._mv, self._mm
        self._mv = None
        self._mm = None
        unmap(mv, mm)
        if unlink:
            # Only our own file: another arena may have replaced it at this path.
            try:
                st = os.stat(self._path, follow_symlinks=False)
                if (st.st_dev, st.st_ino) == self._file_id:
                    os.unlink(self._path)
            except FileNotFoundError:
                pass

    def __enter__(self) -> "Arena":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else "open"
        return (f"Arena({self._path!r}, size_bytes={self._size}, page_bytes={self._page_bytes}, "
                f"page_count={self._page_count}, {state})")
