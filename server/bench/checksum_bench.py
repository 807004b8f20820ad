"""Checksum benchmark: GB/s of each block checksum kvkeeper could use, against
a memcpy of the same bytes, by block size, in one run.

For each block size (256 KiB, 1 MiB, 4 MiB) the same N blocks of random
bytes (N * block = 256 MiB, 32 MiB with --quick: more than the last-level
cache, as blocks come from the arena, not from cache) are checksummed one
block at a time by each kind:

* zlib.crc32: the old default (CRC32, table/PCLMUL code in zlib);
* xxh3_64: `xxhash.xxh3_64_intdigest` of the whole block (one-shot);
* xxh3_64 incremental: `xxhash.xxh3_64()` updated with the block in
  PIECES pieces, as the connector hashes a block that spans layers straight
  from the KV cache (one piece per layer), then `intdigest()`; the same value
  as the one-shot hash of the joined bytes;
* crc32c (google-crc32c) and crc32c (crc32c package): hardware CRC32C
  (SSE4.2), each only where its package is installed (the `bench` extra);
* copy+verify, what a verified load costs: np.copyto of each block then
  xxh3_64 of its destination (fused per block: hashed while hot in cache);
  xxh3_64 of each source then np.copyto (on the source); and every block
  copied, then every destination hashed (two passes, as a load that copies
  all blocks in before checking them). Their GB/s are of block bytes copied
  and checked.

Baseline: `np.copyto` of each block into a preallocated array of the same
shape, measured in the same repetitions. Kinds alternate order within each
repetition after an untimed warm-up; the median is reported. A checksum's
target is an absolute >= 10 GB/s (issue 12: integrity at memory speed); its
ratio to memcpy is shown beside it.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, List

import numpy as np
import xxhash

from .result import Result, median
from .sizes import BlockScale, size_label as _size_label

PIECES = 6              # layers of issue 12's M2 model: a block is 6 per-layer pieces
TARGET_GBPS = ">= 10"
COPY_KINDS = ("copy_then_xxh3_dst", "xxh3_src_then_copy", "copy_all_then_xxh3_all")


class Scale(BlockScale):
    """Block sizes and bytes as `bench data` (sizes.py); more repetitions, as
    one repetition here takes well under a second."""
    FULL_REPS = 9


def _xxh3_pieces(block: np.ndarray) -> int:
    h = xxhash.xxh3_64()
    step = -(-block.nbytes // PIECES)
    for off in range(0, block.nbytes, step):
        h.update(block[off:off + step])
    return h.intdigest()


def _crc32c_kinds() -> Dict[str, tuple[str, Callable[[Any], int]]]:
    """The hardware CRC32C implementations installed here: kind -> (label, fn)."""
    kinds: Dict[str, tuple[str, Callable[[Any], int]]] = {}
    try:
        import google_crc32c
        if google_crc32c.implementation == "c":   # "python": the pure-Python fallback
            kinds["google_crc32c"] = ("google-crc32c value (CRC32C, SSE4.2)", google_crc32c.value)
    except ImportError:
        pass
    try:
        import crc32c
        if crc32c.hardware_based:
            kinds["crc32c"] = ("crc32c.crc32c (CRC32C, SSE4.2)", crc32c.crc32c)
    except ImportError:
        pass
    return kinds


class _SizeRun:
    """Every kind over n blocks of `bs` bytes."""

    def __init__(self, bs: int, scale: Scale) -> None:
        import zlib

        self.bs, self.n = bs, scale.move_bytes // bs
        rng = np.random.default_rng(bs)
        self.src = rng.integers(0, 256, size=(self.n, bs), dtype=np.uint8)
        self.dst = np.zeros_like(self.src)
        self.blocks = [self.src[i] for i in range(self.n)]
        self.outs = [self.dst[i] for i in range(self.n)]
        self.labels: Dict[str, str] = {
            "zlib_crc32": "zlib.crc32 (CRC32)",
            "xxh3_64": "xxhash.xxh3_64_intdigest (one-shot)",
            "xxh3_64_pieces": f"xxhash.xxh3_64().update x{PIECES} pieces (per layer)",
        }
        fns: Dict[str, Callable[[Any], int]] = {
            "zlib_crc32": zlib.crc32, "xxh3_64": xxhash.xxh3_64_intdigest,
            "xxh3_64_pieces": _xxh3_pieces}
        for kind, (label, fn) in _crc32c_kinds().items():
            self.labels[kind] = label
            fns[kind] = fn
        self.kinds: Dict[str, Callable[[], float]] = {"memcpy": self.memcpy}
        for kind, fn in fns.items():
            self.kinds[kind] = self._timer(fn)
        self.kinds["copy_then_xxh3_dst"] = self.copy_then_hash
        self.kinds["xxh3_src_then_copy"] = self.hash_then_copy
        self.kinds["copy_all_then_xxh3_all"] = self.copy_all_then_hash_all
        self.labels["copy_then_xxh3_dst"] = "per block: np.copyto, then xxh3_64 of the destination"
        self.labels["xxh3_src_then_copy"] = "per block: xxh3_64 of the source, then np.copyto"
        self.labels["copy_all_then_xxh3_all"] = "np.copyto of every block, then xxh3_64 of each"
        self._check_incremental()

    def _check_incremental(self) -> None:
        # The pieces kind must compute what the one-shot hash of the block does.
        if _xxh3_pieces(self.blocks[0]) != xxhash.xxh3_64_intdigest(self.blocks[0]):
            raise RuntimeError("incremental xxh3_64 differs from the one-shot hash")

    def _timer(self, fn: Callable[[Any], int]) -> Callable[[], float]:
        blocks = self.blocks

        def timed() -> float:
            t0 = time.perf_counter()
            for b in blocks:
                fn(b)
            return time.perf_counter() - t0
        return timed

    def memcpy(self) -> float:
        t0 = time.perf_counter()
        for a, b in zip(self.outs, self.blocks):
            np.copyto(a, b)
        return time.perf_counter() - t0

    def copy_then_hash(self) -> float:
        h = xxhash.xxh3_64_intdigest
        t0 = time.perf_counter()
        for a, b in zip(self.outs, self.blocks):
            np.copyto(a, b)
            h(a)
        return time.perf_counter() - t0

    def hash_then_copy(self) -> float:
        h = xxhash.xxh3_64_intdigest
        t0 = time.perf_counter()
        for a, b in zip(self.outs, self.blocks):
            h(b)
            np.copyto(a, b)
        return time.perf_counter() - t0

    def copy_all_then_hash_all(self) -> float:
        h = xxhash.xxh3_64_intdigest
        t0 = time.perf_counter()
        for a, b in zip(self.outs, self.blocks):
            np.copyto(a, b)
        for a in self.outs:
            h(a)
        return time.perf_counter() - t0

    def measure(self, reps: int) -> Dict[str, List[float]]:
        times: Dict[str, List[float]] = {k: [] for k in self.kinds}
        for rep in range(reps + 1):   # rep 0 is the warm-up
            order = list(self.kinds) if rep % 2 == 0 else list(reversed(self.kinds))
            for k in order:
                t = self.kinds[k]()
                if rep:
                    times[k].append(t)
        return times


def _results(run: _SizeRun, times: Dict[str, List[float]], scale: Scale) -> List[Result]:
    label = _size_label(run.bs)
    nbytes = run.n * run.bs
    gbps = {k: nbytes / median(v) / 1e9 for k, v in times.items()}
    base = {"block_bytes": run.bs, "blocks": run.n, "bytes": nbytes, "reps": scale.reps}
    out = []
    for kind, value in gbps.items():
        if kind == "memcpy":
            continue
        fused = kind in COPY_KINDS
        out.append(Result(
            name=f"checksum.{kind}.gbps.{label}", value=value, unit="GB/s",
            baseline_name="np.copyto of the same blocks", baseline_value=gbps["memcpy"],
            better="higher", target=None if fused else TARGET_GBPS,
            target_of="value", params={**base, **({"pieces": PIECES} if "pieces" in kind else {})},
            note=run.labels[kind] + ("; GB/s of block bytes copied and checked" if fused else "")))
    return out


def run(quick: bool = False, *, scale: Scale | None = None,
        log: Callable[[str], None] = lambda s: None) -> List[Result]:
    scale = scale or Scale.for_mode(quick)
    results: List[Result] = []
    for bs in scale.block_sizes:
        run_ = _SizeRun(bs, scale)
        log(f"checksum: {_size_label(bs)} blocks, {run_.n} per measurement, "
            f"kinds: {', '.join(run_.kinds)}")
        results += _results(run_, run_.measure(scale.reps), scale)
        del run_
    return results
