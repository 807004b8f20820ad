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
path. The copies (`write`, `read`, `read_into`, from the mapping class both
sides share, kvkeeper.client.arena_mapping.ArenaMapping) serve the streaming
path, for clients that cannot map the file, and the disk tier.

The file is created sparse (ftruncate) so pages are backed by memory only when
first touched.
"""
from __future__ import annotations

import os
from operator import index as _index


from ..ledger.pages import Pages, page_runs

from kvkeeper.client.arena_format import (ARENA_ID_BYTES, FORMAT_VERSION, HEADER_BYTES, MAGIC, PAGE_ALIGN,
                                          Extent, write_header)
from kvkeeper.client.arena_mapping import ArenaMapping, file_id, map_file

# FORMAT_VERSION, HEADER_BYTES, MAGIC: the layout, for callers that check the file.
__all__ = ["Arena", "PAGE_ALIGN", "FORMAT_VERSION", "HEADER_BYTES", "MAGIC"]



class Arena(ArenaMapping):
    """The daemon's mapping of the host-tier file. Create with `Arena.create`.
    Views and copies are ArenaMapping's; this adds the file's creation, the
    block layout on pages, and unlinking at close."""

    __slots__ = ()

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
            mm = map_file(fd, size_bytes)
        except BaseException:
            os.close(fd)
            try:
                os.unlink(path)
            except OSError:
                pass
            raise
        os.close(fd)  # mmap holds its own reference to the file
        arena_id = os.urandom(ARENA_ID_BYTES)
        write_header(mm, arena_id, page_bytes, page_count)
        return cls(path, size_bytes, arena_id, page_bytes, page_count, HEADER_BYTES, file_id(st),
                   mm)

    # ---- layout

    def extents(self, pages: Pages, n_pages: int, nbytes: int) -> list[Extent]:
        """(file offset, length) pieces covering the first `nbytes` of a block's
        pages, one per contiguous run, in block order; lengths add up to nbytes."""
        pb, page_count = self.page_bytes, self.page_count
        # The common case, one contiguous run (an int), checked in one step:
        # every save and load asks this once per block.
        if (type(pages) is int and 0 <= pages and 0 < n_pages <= page_count - pages
                and 0 < nbytes <= n_pages * pb):
            return [(self.data_offset + pages * pb, nbytes)]
        if n_pages <= 0:
            raise ValueError(f"a block has at least one page, got n_pages={n_pages}")
        if not isinstance(pages, int) and len(pages) != n_pages:
            raise ValueError(f"{len(pages)} pages given with n_pages={n_pages}")
        if nbytes < 0 or nbytes > n_pages * pb:
            raise ValueError(f"nbytes={nbytes} does not fit in {n_pages} pages of {pb} bytes")
        out: list[Extent] = []
        left = nbytes
        base = self.data_offset
        for first, count in page_runs(pages, n_pages):
            if first < 0 or first + count > page_count:
                raise ValueError(f"pages {first}..{first + count - 1} out of range "
                                 f"(page_count={page_count})")
            if left == 0:
                continue  # keep validating the remaining runs
            length = min(count * pb, left)
            out.append((base + first * pb, length))
            left -= length
        return out

    # ---- lifetime

    def close(self, unlink: bool = True) -> None:
        """Unmap (see ArenaMapping.close: live views keep the mapping until they
        are dropped) and, by default, unlink the file. Idempotent."""
        if self.closed:
            return
        super().close()
        if unlink:
            # Only our own file: another arena may have replaced it at this path.
            try:
                st = os.stat(self.path, follow_symlinks=False)
                if self.is_mapped_file(st):
                    os.unlink(self.path)
            except FileNotFoundError:
                pass
