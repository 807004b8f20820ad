"""Keeping a directory several daemons share within one budget.

Each daemon's book bounds the blocks it knows (disk_tier.capacity_bytes), and
only the GC owner deletes files, only those its own book evicted
(disk_tier.py). So in a directory several daemons share, the files the other
daemons' books forgot were never deleted, and the directory grew without
bound. With disk_tier.shared_capacity_bytes set, the GC owner also lists the
whole directory now and then; while its block files exceed that budget it
deletes the least recently used of them (by mtime: a write sets it, and each
daemon touches a file it reads) that its own book does not hold and that no
other daemon pins. Its own book's files go the usual way, when that book
evicts them (files found at start-up beyond the book's capacity are not in it).

Another daemon whose book still lists a deleted file reads it as gone
(NotStored): a miss, never wrong bytes. A file rewritten after the listing
(its mtime moved) is left for the next pass.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from .fileio import RDONLY
from .header import HEADER_FIELDS_BYTES, parse_header
from .layout import BLOCK_SUFFIX, Layout, subdirs

__all__ = ["CollectReport", "collect", "list_blocks"]


@dataclass
class CollectReport:
    files: int = 0            # block files listed
    bytes: int = 0            # their size on disk, before the pass
    deleted: int = 0
    freed: int = 0            # bytes
    kept_pinned: int = 0      # candidates another daemon was reading
    seconds: float = 0.0


Listed = tuple[float, int, str]   # (mtime, file bytes, path)


def list_blocks(layout: Layout) -> Iterator[Listed]:
    """Every block file under the layout, with its mtime and size (one stat
    each; no file is opened)."""
    for ns_dir in subdirs(layout.blocks_dir, 16):
        leaves = subdirs(ns_dir.path, 2)
        for _ in range(layout.fanout_levels - 1):
            leaves = [e for d in leaves for e in subdirs(d.path, 2)]
        for leaf in leaves:
            try:
                with os.scandir(leaf.path) as it:
                    entries = [e for e in it if e.name.endswith(BLOCK_SUFFIX)]
            except FileNotFoundError:
                continue
            for e in entries:
                try:
                    st = e.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue   # deleted by another daemon meanwhile
                yield st.st_mtime, st.st_size, e.path


def _identity(path: str) -> Optional[tuple[bytes, bytes]]:
    """The (namespace, key) a block file's header names; None if unreadable."""
    try:
        fd = os.open(path, RDONLY)
    except OSError:
        return None
    try:
        h = parse_header(os.pread(fd, HEADER_FIELDS_BYTES, 0))
    except OSError:
        return None
    finally:
        os.close(fd)
    return None if h is None else (h[0], h[1])


def collect(layout: Layout, budget_bytes: int, *, held: Callable[[bytes, bytes], bool],
            delete: Callable[[bytes, bytes], Optional[int]]) -> CollectReport:
    """One pass: delete least recently used block files until the listed ones
    fit `budget_bytes`. `held(ns, key)`: this daemon's book holds the block
    (left to the book). `delete(ns, key)`: the bytes freed, or None when
    another daemon pins the file."""
    t0 = time.perf_counter()
    listed = sorted(list_blocks(layout))
    report = CollectReport(files=len(listed), bytes=sum(size for _, size, _ in listed))
    total = report.bytes
    for mtime, size, path in listed:
        if total <= budget_bytes:
            break
        ident = _identity(path)
        if ident is None or held(*ident):
            continue   # a bad header is for a read to quarantine; a held block, for the book
        try:
            if os.stat(path, follow_symlinks=False).st_mtime != mtime:
                continue   # written or read again since the listing
        except FileNotFoundError:
            total -= size  # gone already
            continue
        freed = delete(*ident)
        if freed is None:
            report.kept_pinned += 1
            continue
        report.deleted += 1
        report.freed += freed
        total -= size
    report.seconds = time.perf_counter() - t0
    return report
