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

The file is created sparse (ftruncate). With `prefault` (host_tier.prefault,
the default) every page is then allocated and mapped at once
(MADV_POPULATE_WRITE), for two reasons:
* a /dev/shm too small for the arena fails the start with a message that says
  so, where a sparse file would kill whoever first writes a page past the
  tmpfs's room with SIGBUS (a vLLM worker saving a block, say);
* a client maps the pages that hold data when it attaches (arena_mapping's
  populate), now all of them: no load or save takes a page fault. A first
  read through a fresh mapping ran at 0.7x a mapped one here (4 KiB faults).
It costs ~0.4 s per GiB at start-up, and the arena's memory is taken then
rather than as blocks fill it (a cache of a configured size: vLLM allocates
its own KV cache the same way).
"""
from __future__ import annotations

import errno
import logging
import mmap
import os
from operator import index as _index
from typing import Callable, Optional, Sequence


from ..ledger.pages import Pages, page_runs

from kvkeeper.client.arena_format import (ARENA_ID_BYTES, FORMAT_VERSION, HEADER_BYTES, MAGIC, PAGE_ALIGN,
                                          Extent, write_header)
from kvkeeper.client.arena_mapping import POPULATE_STEP, ArenaMapping, file_id, map_file

# FORMAT_VERSION, HEADER_BYTES, MAGIC: the layout, for callers that check the file.
__all__ = ["Arena", "ArenaSpaceError", "PAGE_ALIGN", "FORMAT_VERSION", "HEADER_BYTES", "MAGIC",
           "prefault"]

log = logging.getLogger("kvkeeper")

# madvise(MADV_POPULATE_WRITE), Linux 5.14+ (Python 3.11's mmap has no name for it).
MADV_POPULATE_WRITE = getattr(mmap, "MADV_POPULATE_WRITE", 23)


class ArenaSpaceError(OSError):
    """The arena's directory (a tmpfs) cannot hold the whole arena."""


def prefault(mm: mmap.mmap, fd: int, path: str, size_bytes: int,
             progress: Optional[Callable[[int], None]] = None) -> str:
    """Allocate every page of the file `fd` (mapped whole as `mm`) and map it
    in `mm`: "populated"; where the kernel cannot populate (before 5.14),
    allocate the file's blocks only (posix_fallocate): "allocated"; where
    the filesystem cannot do that either, nothing: "sparse" (logged).
    ArenaSpaceError when the filesystem cannot hold them all. `progress`
    is called with the bytes done after each step (a large arena takes a
    while: the daemon extends systemd's start timeout from it)."""
    def no_room() -> ArenaSpaceError:
        try:
            st = os.statvfs(os.path.dirname(path) or ".")
            free = f"{st.f_bavail * st.f_frsize / 2**30:.2f} GiB free there now"
        except OSError:
            free = "its free space unknown"
        return ArenaSpaceError(
            errno.ENOSPC,
            f"the host tier's arena needs {size_bytes / 2**30:.2f} GiB in "
            f"{os.path.dirname(path)} ({free}): lower host_tier.capacity_bytes or enlarge that "
            "tmpfs (docker: --shm-size; Kubernetes: the node's /dev/shm)")

    try:
        for off in range(0, size_bytes, POPULATE_STEP):
            n = min(POPULATE_STEP, size_bytes - off)
            mm.madvise(MADV_POPULATE_WRITE, off, n)
            if progress is not None:
                progress(off + n)
        return "populated"
    except OSError as e:
        if e.errno in (errno.EFAULT, errno.ENOMEM, errno.ENOSPC):   # EFAULT: it would SIGBUS
            raise no_room() from None
        if e.errno not in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
            raise
    try:
        os.posix_fallocate(fd, 0, size_bytes)
    except OSError as e:
        if e.errno == errno.ENOSPC:
            raise no_room() from None
        if e.errno not in (errno.EINVAL, errno.EOPNOTSUPP):
            raise
        log.warning("host tier: %s can neither populate nor preallocate the arena; it stays "
                    "sparse (a full filesystem would SIGBUS a later writer)",
                    os.path.dirname(path))
        return "sparse"
    return "allocated"



class Arena(ArenaMapping):
    """The daemon's mapping of the host-tier file. Create with `Arena.create`.
    Views and copies are ArenaMapping's; this adds the file's creation, the
    block layout on pages, and unlinking at close."""

    __slots__ = ()

    @classmethod
    def create(cls, path: str, size_bytes: int, page_bytes: int,
               prefault_pages: bool = False,
               progress: Optional[Callable[[int], None]] = None) -> "Arena":
        """Create (or replace) the arena file at `path` and map it; with
        `prefault_pages`, every page allocated and mapped now (`prefault`,
        which calls `progress`)."""
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
            if prefault_pages:
                try:
                    prefault(mm, fd, path, size_bytes, progress)
                except BaseException:
                    mm.close()
                    raise
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

    def run_offsets(self, pages: Sequence[Optional[Pages]], n_pages: int,
                    nbytes: int) -> Optional[list[Optional[int]]]:
        """extents()' answer for a batch of blocks of one namespace, where each
        is one contiguous run: the file offset of each (None stays None: a
        slot with no block). None when any is not a single run in range, for
        the caller to ask extents() block by block. A reservation's or
        lease's blocks are almost always single runs, and this is a third of
        the cost of building an extent list per block."""
        pb, base = self.page_bytes, self.data_offset
        last = self.page_count - n_pages
        if not (0 < n_pages and 0 < nbytes <= n_pages * pb):
            return None
        out: list[Optional[int]] = []
        for p in pages:
            if p is None:
                out.append(None)
            elif type(p) is int and 0 <= p <= last:
                out.append(base + p * pb)
            else:
                return None
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
