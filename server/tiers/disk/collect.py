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

A victim is taken by renaming it to a private name first, then checked: the
file captured must be the one listed (same inode and mtime) and still not in
the owner's book; otherwise it is linked back (a save that renamed a new copy
into place after the listing keeps it). So a collection never removes a copy
acknowledged after its listing. Another daemon whose book still lists a
deleted file reads it as gone (NotStored): a miss, never wrong bytes.
"""
from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Callable, Iterator, Optional

from .fileio import RDONLY
from .header import HEADER_FIELDS_BYTES, parse_header
from .layout import BLOCK_SUFFIX, Layout, leaf_dirs, subdirs

__all__ = ["CollectReport", "Victims", "collect", "list_blocks"]


@dataclass
class CollectReport:
    files: int = 0            # block files listed
    bytes: int = 0            # their size on disk, before the pass
    deleted: int = 0
    freed: int = 0            # bytes
    kept_pinned: int = 0      # candidates another daemon was reading
    errors: int = 0           # files that could not be deleted
    last_error: str = ""
    gone: int = 0             # bytes others deleted after the listing
    stopped: bool = False     # ended early: the GC lease was lost, or the tier closes
    seconds: float = 0.0


TAKEN, GONE, KEPT = "taken", "gone", "kept"


def list_blocks(layout: Layout) -> Iterator[tuple[str, os.stat_result]]:
    """Every block file under the layout, with its stat (one stat each; no
    file is opened)."""
    tops = [top for ns_dir in subdirs(layout.blocks_dir, 16) for top in subdirs(ns_dir.path, 2)]
    for top in tops:
        for leaf, _ in leaf_dirs(top.path, top.name, layout.fanout_levels):
            try:
                with os.scandir(leaf) as it:
                    entries = [e for e in it if e.name.endswith(BLOCK_SUFFIX)]
            except FileNotFoundError:
                continue
            for e in entries:
                try:
                    st = os.stat(e.path, follow_symlinks=False)   # with the inode number
                except FileNotFoundError:
                    continue   # deleted by another daemon meanwhile
                yield e.path, st


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


class Victims:
    """What a pass may delete, and how, for one owner: `held(ns, key)` (its book
    holds the block: the book's to evict), `pinned(ns, key)` (another daemon
    is reading it), `forget(ns, key)` (drop it from the owner's store index),
    `tmp_path()` (a private name in the same filesystem)."""

    def __init__(self, *, held: Callable[[bytes, bytes], bool],
                 pinned: Callable[[bytes, bytes], bool],
                 forget: Callable[[bytes, bytes], None], tmp_path: Callable[[], str]) -> None:
        self.held, self.pinned, self.forget, self.tmp_path = held, pinned, forget, tmp_path

    def take(self, path: str, listed: os.stat_result, ident: tuple[bytes, bytes]) -> str:
        """Delete the file at `path` if it is still the one listed and free to
        go: TAKEN; GONE (deleted by someone else); KEPT (a newer copy, or held)."""
        tmp = self.tmp_path()
        try:
            os.rename(path, tmp)          # captured: no save can land on this name now
        except FileNotFoundError:
            return GONE
        try:
            st = os.stat(tmp, follow_symlinks=False)
            mine = (st.st_ino, st.st_dev, st.st_mtime_ns) == \
                (listed.st_ino, listed.st_dev, listed.st_mtime_ns) and not self.held(*ident)
        except BaseException:
            _put_back(tmp, path)          # whatever failed, the copy goes back
            raise
        if not mine:
            _put_back(tmp, path)          # not ours to take
            return KEPT
        os.unlink(tmp)
        self.forget(*ident)
        return TAKEN


def _put_back(tmp: str, path: str) -> None:
    """Return a captured file to its name, unless a newer copy landed there."""
    try:
        os.link(tmp, path)
    except FileExistsError:
        pass                              # the newer copy wins (same key, same bytes)
    except OSError:
        os.rename(tmp, path)              # no hard links here: over the newer copy, if any
        return
    os.unlink(tmp)


def collect(layout: Layout, budget_bytes: int, victims: Victims,
            keep_going: Callable[[], bool] = lambda: True) -> CollectReport:
    """One pass: delete least recently used block files until the listed ones
    fit `budget_bytes`. `keep_going()` is asked before each file (the caller
    renews its GC lease there, by time); False ends the pass."""
    t0 = time.perf_counter()
    listed: list[tuple[int, str, os.stat_result]] = []
    for path, st in list_blocks(layout):
        if not keep_going():
            return CollectReport(stopped=True, seconds=time.perf_counter() - t0)
        listed.append((st.st_mtime_ns, path, st))
    listed.sort()
    report = CollectReport(files=len(listed), bytes=sum(st.st_size for _, _, st in listed))
    total = report.bytes
    for _, path, st in listed:
        if total <= budget_bytes:
            break
        if not keep_going():
            report.stopped = True
            break
        ident = _identity(path)
        if ident is None or victims.held(*ident):
            continue   # a bad header is for a read to quarantine; a held block, for the book
        try:
            if victims.pinned(*ident):
                report.kept_pinned += 1
                continue
            outcome = victims.take(path, st, ident)
        except OSError as e:          # this file only (EPERM, EIO ...): the pass goes on
            report.errors += 1
            report.last_error = str(e)
            continue
        if outcome == TAKEN:
            report.deleted += 1
            report.freed += st.st_size
        if outcome == GONE:
            report.gone += st.st_size
        if outcome != KEPT:
            total -= st.st_size
    report.seconds = time.perf_counter() - t0
    return report
