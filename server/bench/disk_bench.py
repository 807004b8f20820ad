"""Disk tier: DiskStore save/load GB/s against raw file I/O of the same bytes,
and restart (index rebuild) time against the number of blocks on disk.

Save: DiskStore.write (XXH3-64 of the payload, header + payload into a tmp
file, rename, and what makes it durable on this filesystem: durability.py)
against open + write + fsync + close of one new file per block. Load:
DiskStore.read_into (one preadv of header and payload, or one per 256 KiB
piece past 1 MiB, header check, XXH3-64 verify) against open + preadv +
close, both from a warm page cache. Both sides run on the daemon's disk
thread-pool width (4 threads), taking turns a few blocks at a time (a shared
machine's load then hits both alike). Each
side keeps its directories across rounds and starts a round with the previous
round's files deleted: a store creates a namespace's fan-out directories once
in its life, not once per block, and the raw side writes into an existing
directory too (round 0 warms both up).
Restart: DiskStore.open of a directory of N blocks (warm cache, as after
kill -9) against a bare os.scandir walk of the same tree, the floor of any
index rebuild from a directory.
"""
from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable

import numpy as np

from ..tiers.disk import DiskStore
from .result import Result

KiB, MiB = 1 << 10, 1 << 20
NS = bytes(range(16))
THREADS = 4
SLICE = 2 * THREADS   # blocks per side per turn (_interleaved)


def _par(pool: ThreadPoolExecutor, fn: Callable[[Any], Any], items: list[Any]) -> float:
    t0 = time.perf_counter()
    list(pool.map(fn, items))
    return time.perf_counter() - t0


def _raw_write(args: tuple[str, Any]) -> None:
    path, data = args
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o640)
    try:
        mv = memoryview(data)
        off = 0
        while off < len(mv):
            off += os.pwrite(fd, mv[off:], off)
        os.fsync(fd)
    finally:
        os.close(fd)


def _raw_read(args: tuple[str, Any]) -> None:
    path, out = args
    fd = os.open(path, os.O_RDONLY)
    try:
        os.preadv(fd, [out], 0)
    finally:
        os.close(fd)


def _interleaved(pool: ThreadPoolExecutor, sides: list[tuple[str, Callable[[Any], Any], list[Any]]],
                 rnd: int, times: dict[str, list[float]]) -> None:
    """Run kvkeeper and baseline slice by slice (SLICE items each), which side
    goes first alternating, so both meet the same background load on a shared
    machine; round 0 only warms up."""
    total = {k: 0.0 for k, _, _ in sides}
    for j, start in enumerate(range(0, len(sides[0][2]), SLICE)):
        for k, fn, items in (sides if (rnd + j) % 2 == 0 else sides[::-1]):
            total[k] += _par(pool, fn, items[start:start + SLICE])
    if rnd:
        for k, dt in total.items():
            times[k].append(dt)


def _walk(top: str) -> int:
    n = 0
    stack = [top]
    while stack:
        with os.scandir(stack.pop()) as it:
            for e in it:
                if e.is_dir(follow_symlinks=False):
                    stack.append(e.path)
                else:
                    n += 1
    return n


def _throughput(root: str, quick: bool, log: Callable[[str], None]) -> list[Result]:
    total = (16 if quick else 96) * MiB
    rounds = 2 if quick else 3
    results = []
    rng = np.random.default_rng(0)
    with ThreadPoolExecutor(THREADS) as pool:
        for size in (256 * KiB, 1 * MiB, 4 * MiB):
            n = max(4, total // size)
            blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
            outs = [np.empty(size, dtype=np.uint8) for _ in range(n)]
            t: dict[str, list[float]] = {"ws": [], "wr": [], "rs": [], "rr": []}
            shutil.rmtree(root, ignore_errors=True)
            store, _ = DiskStore.open(os.path.join(root, "store"), owner_id="bench")
            raw = os.path.join(root, "raw")
            os.makedirs(raw)
            paths = [os.path.join(raw, f"{i}") for i in range(n)]
            keys: list[bytes] = []
            for rnd in range(rounds + 1):  # round 0 warms up
                for k in keys:
                    store.delete(NS, k)
                for p in paths:
                    if os.path.exists(p):
                        os.unlink(p)
                keys = [os.urandom(32) for _ in range(n)]
                _interleaved(pool, [
                    ("ws", lambda kb: store.write(NS, kb[0], kb[1]), list(zip(keys, blocks))),
                    ("wr", _raw_write, list(zip(paths, blocks)))], rnd, t)
                _interleaved(pool, [
                    ("rs", lambda ko: store.read_into(NS, ko[0], ko[1]), list(zip(keys, outs))),
                    ("rr", _raw_read, list(zip(paths, outs)))], rnd, t)
            nbytes = n * size
            gbps = {k: nbytes / statistics.median(v) / 1e9 for k, v in t.items()}
            label = f"{size // KiB}KiB" if size < MiB else f"{size // MiB}MiB"
            params = {"block_bytes": size, "blocks": n, "threads": THREADS, "rounds": rounds}
            results.append(Result(
                f"disk.save_gbps.{label}", gbps["ws"], "GB/s",
                "raw open+write+fsync+close per block", gbps["wr"], "higher", ">= 0.7",
                params={**params, "durability": store.durability},
                note="DiskStore.write: XXH3-64, tmp file, rename, durable as durability.py says"))
            results.append(Result(
                f"disk.load_gbps.{label}", gbps["rs"], "GB/s",
                "raw open+preadv+close per block (warm cache)", gbps["rr"], "higher", ">= 0.7",
                params=params,
                note="DiskStore.read_into: preadv (pieces past 1 MiB), header check, "
                     "XXH3-64 verify"))
            log(f"disk {label}: save {gbps['ws']:.2f} vs {gbps['wr']:.2f} GB/s, "
                f"load {gbps['rs']:.2f} vs {gbps['rr']:.2f} GB/s")
    return results


def _restart(root: str, quick: bool, log: Callable[[str], None]) -> list[Result]:
    results = []
    counts = (2_000, 10_000) if quick else (10_000, 100_000)
    payload = bytes(4096)
    shutil.rmtree(root, ignore_errors=True)
    store, _ = DiskStore.open(root, owner_id="bench", fsync=False)
    have = 0
    for n in counts:
        for i in range(have, n):
            store.write(NS, i.to_bytes(32, "little"), payload)
        have = n
        t0 = time.perf_counter()
        files = _walk(os.path.join(root, "blocks"))
        walk_s = time.perf_counter() - t0
        _, report = DiskStore.open(root, owner_id="bench2")
        assert report.blocks == n == files, (report.blocks, n, files)
        results.append(Result(
            f"disk.restart_seconds.{n // 1000}k", report.seconds, "s",
            "os.scandir walk of the same directory tree", walk_s, "lower",
            "< 5" if n >= 100_000 else None, target_of="value",
            params={"blocks": n, "payload_bytes": len(payload), "cache": "warm (as after kill -9)"},
            note="DiskStore.open: tmp cleanup + header scan + index rebuild"))
        log(f"disk restart with {n} blocks: {report.seconds:.2f}s (walk {walk_s:.2f}s)")
    return results


def run(quick: bool = False, *, log: Callable[[str], None] = lambda s: None) -> list[Result]:
    base = tempfile.mkdtemp(prefix="kvkeeper-diskbench-", dir=os.environ.get("KVKEEPER_BENCH_DIR"))
    try:
        return _throughput(os.path.join(base, "io"), quick, log) + \
            _restart(os.path.join(base, "restart"), quick, log)
    finally:
        shutil.rmtree(base, ignore_errors=True)
