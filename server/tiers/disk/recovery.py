"""Start-up recovery: leftover tmp files removed, the index rebuilt from the
block files' headers.

Open rebuilds the index from headers only (magic, version, sizes, header CRC,
path agreement; 100k blocks took ~1.5-2.4 s here from the page cache, as after
kill -9, and ~10-15 s cold); the caller quarantines a file with a bad header.
Leftover tmp files are removed: this owner's (a previous incarnation's) and
anyone's older than `tmp_max_age_s`; other live daemons' fresh tmp files are
left alone.
"""
from __future__ import annotations

import os
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from .fileio import RDONLY
from .header import HEADER_BYTES, HEADER_FIELDS_BYTES, parse_header
from .layout import BLOCK_SUFFIX, TMP_SUFFIX, Layout, leaf_dirs, subdirs, tmp_owner

SCAN_THREADS = 16
_IO_BOUND_S_PER_FILE = 100e-6  # page-cache hits cost ~20 us a file here, device reads ~250

Found = tuple[bytes, bytes, int]  # (ns, key, payload bytes)


@dataclass
class RecoveryReport:
    blocks: int = 0
    bytes: int = 0            # on disk: headers + payloads
    seconds: float = 0.0
    quarantined: int = 0      # files with a bad header, moved to quarantine/
    tmp_removed: int = 0


def clean_tmp(tmp_dir: str, owner_id: str, max_age_s: float) -> int:
    """Remove our own leftover tmp files and anyone's older than max_age_s.
    A fresh tmp file of another owner may be a live daemon's write in progress."""
    removed = 0
    cutoff = time.time() - max_age_s
    mine = owner_id + "-"
    with os.scandir(tmp_dir) as it:
        for e in it:
            if not e.name.endswith(TMP_SUFFIX):
                continue
            owner = tmp_owner(e.name)
            try:
                stale = (owner + "-" == mine) or e.stat(follow_symlinks=False).st_mtime < cutoff
                if stale:
                    os.unlink(e.path)
                    removed += 1
            except FileNotFoundError:
                pass  # removed by another daemon meanwhile
    return removed


def scan(layout: Layout, threads: int | None) -> list[tuple[list[Found], list[str]]]:
    """(valid blocks, paths of bad files) per first-level fan-out dir.

    `threads` None: serial while headers come from the page cache, threads
    once reads wait on the device."""
    # One task per namespace fan-out dir: coarse enough that thread hand-off
    # costs nothing, fine enough to spread a shared mount's latency.
    tasks = [(a.path, ns_e.name, a.name)
             for ns_e in subdirs(layout.blocks_dir, 16) for a in subdirs(ns_e.path, 2)]
    levels = layout.fanout_levels
    results = []
    done = 0
    if threads is None:
        # Serial while headers come from the page cache (threads would only
        # fight over the GIL); parallel once reads wait on the device.
        t0, files = time.perf_counter(), 0
        while done < len(tasks):
            found, bad = _scan_tree(levels, *tasks[done])
            results.append((found, bad))
            done += 1
            files += len(found) + len(bad)
            if files >= 256 and (time.perf_counter() - t0) / files > _IO_BOUND_S_PER_FILE:
                break
        threads = SCAN_THREADS
    rest = tasks[done:]
    if threads > 1 and len(rest) > 1:
        with ThreadPoolExecutor(max_workers=threads) as ex:
            results.extend(ex.map(lambda t: _scan_tree(levels, *t), rest))
    else:
        results.extend(_scan_tree(levels, *t) for t in rest)
    return results


def _scan_tree(fanout_levels: int, top: str, ns_name: str, prefix: str
               ) -> tuple[list[Found], list[str]]:
    """Index the blocks under one first-level fan-out dir (and its
    subdirs, with fanout_levels > 1): headers only, no payload."""
    found: list[Found] = []
    bad: list[str] = []
    for leaf, pre in leaf_dirs(top, prefix, fanout_levels):
        try:
            with os.scandir(leaf) as it:
                names = [e.name for e in it]
        except FileNotFoundError:
            continue
        for name in names:
            if not name.endswith(BLOCK_SUFFIX):
                continue  # e.g. NFS .nfsXXXX files: not ours to judge
            kh = name[:-4]
            path = f"{leaf}/{name}"
            try:
                fd = os.open(path, RDONLY)
            except FileNotFoundError:
                continue  # deleted by another daemon meanwhile
            except OSError:
                bad.append(path)  # e.g. a symlink: nothing we wrote
                continue
            try:
                raw = os.pread(fd, HEADER_FIELDS_BYTES, 0)
                size = os.fstat(fd).st_size
            finally:
                os.close(fd)
            h = parse_header(raw)
            # The name must be the header's key and sit where block_path puts it.
            if (h is None or size != HEADER_BYTES + h[2] or h[1].hex() != kh
                    or not kh.startswith(pre) or h[0].hex()[:16] != ns_name):
                bad.append(path)
                continue
            found.append(h[:3])
    return found, bad
