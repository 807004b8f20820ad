"""Ledger benchmark: pure Python, no server, no I/O. Every figure below is
measured for each eviction policy (names end in .<policy>).

For each population N (10k, 100k, 1M resident blocks; 10k and 100k with --quick)
one ledger is built with a single tier whose page equals the block size
(4096 B) and whose capacity is exactly N blocks, then filled through the
public API (reserve + commit, one session with a huge lease TTL). Every
reserve names RUN = 16 keys, a prefill step's worth: s3fifo's admission
refuses a longer run of fresh keys on a full tier, and files one on a tier
with room as a cold run, which would measure its cold queue instead of
eviction from probation and main. Then:

* match: `Ledger.match` of a 256-key chain (all present, no lease), at random
  positions, per block. Baseline: the least work any match must do, a loop
  of `dict.get` over the same number of fresh keys on the ledger's own
  namespace dict (same size, same memory layout). Keys are fresh bytes objects
  for both (as they come off the wire), so both pay for hashing.
* evict: with the tier full of unreferenced blocks, a reserve of 4096 new
  keys must evict 4096 blocks first; its cost per block is the result. It
  is the daemon's own reserve (reserve_internal, as a promotion: the same
  steps as a client's without the session lookup, and never refused by
  admission), so one call covers the 4096 and no per-call work dilutes the
  per-block figure. Baseline: the same reserve when the pages are free (the
  evicting reservation is aborted, which frees exactly those pages, and
  4096 other new keys are reserved), at the same N. The difference is the
  eviction itself. The cyclic GC is off inside each timed window (frozen
  as well, see below), so no collection lands in a measurement.
* evict, cold caches: the same, each rep preceded at every N by copying a
  256 MiB buffer through the CPU, which evicts the ledger from every cache
  level and the TLB. A 1M-block ledger (~300 MB) never fits in the caches,
  a 10k one (~3 MB) always does: the warm figures' ratio measures that; with
  the caches cold at every size what is left to grow is the work per block.
* evict flatness: evict cost per block at the largest N over the smallest,
  warm and with cold caches. The smallest ledger is kept and measured again
  rep by rep beside the largest, so a change in machine load hits both
  alike. An O(1) eviction keeps this near 1 (cache misses grow a little
  with N); an O(log N) one would be about 1.5 from 10k to 1M, an O(N) one ~100.
* memory: tracemalloc delta from before the ledger is built to after the
  largest fill, per block (1M, or 100k with --quick). Everything the ledger
  holds counts: keys, Block records, the namespace dict, page numbers, the
  policy's links. Baseline, documented: a bare `dict` mapping the same number
  of fresh 32-byte `bytes` keys to None, measured the same way (one key object
  plus one dict slot per block: the floor for any keyed index in Python).

The cyclic GC is paused during fills (only to save time) and the filled ledger
is moved to the permanent generation (`gc.freeze`) before timing, so a full
collection over a million objects cannot land inside one measurement.
"""
from __future__ import annotations

import gc
import random
import time
import tracemalloc
from dataclasses import dataclass
from typing import Any, Callable, Optional, Sequence

from ..ids import HOST
from ..ledger import Ledger, LedgerConfig, NamespaceDescriptor, TierSpec
from ..ledger.policy import DEFAULT_POLICY, POLICIES, S3FIFOPolicy
from .result import Result

BLOCK_BYTES = 4096
CHAIN = 256
BATCH = 4096
KEY_BYTES = 32
RUN = S3FIFOPolicy.RUN           # keys per reserve: a run every policy admits
FLUSH_BYTES = 256 << 20          # > any last-level cache: copied to make them cold


@dataclass(frozen=True)
class Scale:
    sizes: tuple[int, ...]
    memory_blocks: int      # the size whose fill is traced (must be in sizes)
    chains: int             # match measurements per size
    evict_reps: int         # evicting reserves per size
    batch: int = BATCH

    @classmethod
    def for_mode(cls, quick: bool) -> "Scale":
        if quick:
            return cls(sizes=(10_000, 100_000), memory_blocks=100_000, chains=150, evict_reps=5)
        return cls(sizes=(10_000, 100_000, 1_000_000), memory_blocks=1_000_000, chains=1500,
                   evict_reps=9)


def _key(i: int) -> bytes:
    return i.to_bytes(KEY_BYTES, "little")


def keys_range(start: int, n: int) -> list[bytes]:
    return [i.to_bytes(KEY_BYTES, "little") for i in range(start, start + n)]


class Clock:
    """A monotonic `now` for the ledger (it never reads a clock itself)."""

    def __init__(self) -> None:
        self.t = 1.0

    def __call__(self) -> float:
        self.t += 1e-3
        return self.t


def build_filled(n: int, batch: int, clock: Clock,
                 policy: str = DEFAULT_POLICY) -> tuple[Ledger, str]:
    """A ledger whose one tier holds exactly `n` blocks, full of committed unreferenced
    blocks (keys 0..n-1, chains of `batch`), and the id of its session (which never expires)."""
    ledger = Ledger(LedgerConfig(
        tiers=[TierSpec(HOST, n * BLOCK_BYTES, BLOCK_BYTES)], policy=policy,
        key_bytes=KEY_BYTES, max_keys_per_call=max(batch, CHAIN),
        lease_ttl_s=1e12, reservation_timeout_s=1e12))
    session = ledger.register_session(
        "bench", NamespaceDescriptor(model_id="bench", block_tokens=16, block_bytes=BLOCK_BYTES),
        clock())
    sid = session.id
    for start in range(0, n, batch):
        now = clock()
        for rid in reserve_runs(ledger, sid, keys_range(start, min(batch, n - start)), now):
            ledger.commit(sid, rid, now)
    return ledger, sid


def reserve_runs(ledger: Ledger, sid: str, keys: Sequence[bytes], now: float) -> list[int]:
    """Reserve `keys` (all new) in runs of RUN, as prefill steps save them;
    returns the reservation ids."""
    out = []
    for i in range(0, len(keys), RUN):
        rid = ledger.reserve(sid, keys[i:i + RUN], now).reservation_id
        if rid is None:
            raise RuntimeError("bench setup: a reserve of new keys reserved nothing")
        out.append(rid)
    return out


class CacheFlush:
    """Copies a buffer larger than the last-level cache through the CPU, so
    what is measured next finds its memory cold (caches and TLB)."""

    def __init__(self, nbytes: int = FLUSH_BYTES) -> None:
        self._buf = memoryview(bytearray(nbytes))
        self._half = nbytes // 2

    def __call__(self) -> None:
        h = self._half
        self._buf[h:] = self._buf[:h]
        self._buf[:h] = self._buf[h:]


def _dict_walk(d: dict, keys: list[bytes]) -> int:
    get = d.get
    n = 0
    for k in keys:
        if get(k) is None:
            break
        n += 1
    return n


def _measure_match(ledger: Ledger, sid: str, n: int, chains: int, clock: Clock,
                   rng: random.Random) -> tuple[float, float]:
    """(ledger ns per block, dict.get ns per block), interleaved chain by chain."""
    ns_dict = ledger.sessions[sid].ns.blocks   # type: ignore[index]
    t_ledger = t_dict = 0.0
    perf = time.perf_counter
    match = ledger.match
    for _ in range(chains):
        start = rng.randrange(0, n - CHAIN + 1)
        a = keys_range(start, CHAIN)
        b = keys_range(start, CHAIN)
        now = clock()
        t0 = perf()
        r = match(sid, a, lease=False, now=now)
        t1 = perf()
        got = _dict_walk(ns_dict, b)
        t2 = perf()
        if r.matched != CHAIN or got != CHAIN:
            raise RuntimeError(f"bench setup: matched {r.matched}/{got} of {CHAIN}")
        t_ledger += t1 - t0
        t_dict += t2 - t1
    blocks = chains * CHAIN
    return t_ledger / blocks * 1e9, t_dict / blocks * 1e9


class _Filled:
    """A ledger whose one tier is full of N unreferenced committed blocks."""

    def __init__(self, ledger: Ledger, sid: str, n: int, batch: int, clock: Clock) -> None:
        self.ledger, self.sid, self.n, self.clock = ledger, sid, n, clock
        self.k = min(batch, max(1, n // 2))
        self.next_key = n

    def evict_once(self, flush: Optional[CacheFlush] = None) -> tuple[float, float]:
        """(ns/block of a reserve that evicts k blocks, ns/block of a reserve of
        k keys into free pages); leaves the tier full again. `flush`: run
        before each of the two timed windows."""
        ledger, sid, k, tier = self.ledger, self.sid, self.k, self.ledger.top
        if tier.free_pages != 0 or tier.evictable_pages != self.n:
            raise RuntimeError("bench setup: the tier is not full of unreferenced blocks")
        a = keys_range(self.next_key, k)
        b = keys_range(self.next_key + k, k)
        self.next_key += 2 * k
        ev0 = sum(tier.evictions.values())
        now = self.clock()
        ns_id = ledger.sessions[sid].ns.id   # type: ignore[index]
        rid, t_evict = _timed(lambda: ledger.reserve_internal(ns_id, a, now).reservation_id, flush)
        if sum(tier.evictions.values()) - ev0 != k:
            raise RuntimeError("bench setup: the reserve did not evict one block per key")
        ledger.abort_internal(rid, now)      # frees exactly k pages
        now = self.clock()
        rid, t_plain = _timed(lambda: ledger.reserve_internal(ns_id, b, now).reservation_id, flush)
        ledger.commit_internal(rid, now)
        return t_evict / k * 1e9, t_plain / k * 1e9


def _timed(fn: Callable[[], Any], flush: Optional[CacheFlush]) -> tuple[Any, float]:
    """fn()'s result and its seconds, with the cyclic GC off (after `flush`)."""
    if flush is not None:
        flush()
    was = gc.isenabled()
    gc.disable()
    try:
        t0 = time.perf_counter()
        out = fn()
        return out, time.perf_counter() - t0
    finally:
        if was:
            gc.enable()


def _median(xs: list[float]) -> float:
    ys = sorted(xs)
    mid = len(ys) // 2
    return ys[mid] if len(ys) % 2 else (ys[mid - 1] + ys[mid]) / 2


def _dict_baseline_bytes(n: int) -> float:
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        d: dict[bytes, None] = {}
        for start in range(0, n, BATCH):
            for k in keys_range(start, min(BATCH, n - start)):
                d[k] = None
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    del d
    return used / n


def run(quick: bool = False, *, scale: Optional[Scale] = None,
        log: Callable[[str], None] = lambda s: None, seed: int = 1,
        policies: Optional[Sequence[str]] = None) -> list[Result]:
    """Every figure for each policy (default: all of POLICIES), named .<policy>."""
    scale = scale or Scale.for_mode(quick)
    if scale.memory_blocks not in scale.sizes:
        raise ValueError("memory_blocks must be one of sizes")
    log(f"ledger: dict baseline for memory at {scale.memory_blocks} keys")
    dict_bytes = _dict_baseline_bytes(scale.memory_blocks)
    results: list[Result] = []
    for policy in policies or sorted(POLICIES):
        results += _run_policy(policy, scale, log, seed, dict_bytes)
    return results


def _run_policy(policy: str, scale: Scale, log: Callable[[str], None], seed: int,
                dict_bytes: float) -> list[Result]:
    rng = random.Random(seed)
    results: list[Result] = []
    evict_by_size: dict[tuple[int, bool], float] = {}   # (N, cold caches) -> ns/block
    mem_per_block = 0.0
    sizes = sorted(scale.sizes)
    lo, hi = sizes[0], sizes[-1]
    small: Optional[_Filled] = None     # kept, to be measured again beside the largest
    beside_hi: dict[bool, list[float]] = {False: [], True: []}
    flush = CacheFlush()
    gc_was_enabled = gc.isenabled()
    for n in sizes:
        clock = Clock()
        traced = n == scale.memory_blocks
        log(f"ledger: {policy}: filling {n} blocks{' (traced by tracemalloc)' if traced else ''}")
        gc.collect()
        gc.disable()
        t_fill = time.perf_counter()
        try:
            if traced:
                tracemalloc.start()
                base = tracemalloc.get_traced_memory()[0]
                ledger, sid = build_filled(n, scale.batch, clock, policy)
                gc.collect()
                used = tracemalloc.get_traced_memory()[0] - base
                tracemalloc.stop()
                mem_per_block = used / n
            else:
                ledger, sid = build_filled(n, scale.batch, clock, policy)
        finally:
            if gc_was_enabled:
                gc.enable()
        t_fill = time.perf_counter() - t_fill
        filled = _Filled(ledger, sid, n, scale.batch, clock)
        gc.collect()
        gc.freeze()
        try:
            log(f"ledger: {policy}: {n} blocks filled in {t_fill:.1f}s; timing match and evict")
            m_ledger, m_dict = _measure_match(ledger, sid, n, scale.chains, clock, rng)
            reps: dict[bool, list[tuple[float, float]]] = {False: [], True: []}
            for _ in range(scale.evict_reps):
                for cold in (False, True):
                    reps[cold].append(filled.evict_once(flush if cold else None))
                    if n == hi and small is not None:
                        beside_hi[cold].append(small.evict_once(flush if cold else None)[0])
            if n <= 100_000:
                ledger.check_invariants()
        finally:
            gc.unfreeze()
        if n == lo:
            small = filled
        del ledger, filled
        gc.collect()
        label = size_label(n)
        results.append(Result(
            name=f"ledger.match_ns_per_block.{label}.{policy}", value=m_ledger, unit="ns/block",
            baseline_name="dict.get loop over the same keys", baseline_value=m_dict,
            better="lower", params={"resident_blocks": n, "chain": CHAIN, "chains": scale.chains,
                                    "lease": False, "policy": policy},
            note="Ledger.match of a 256-key chain; the ratio is the ledger's overhead over a bare lookup"))
        for cold in (False, True):
            ev = evict_by_size[(n, cold)] = _median([e for e, _ in reps[cold]])
            results.append(Result(
                name=f"ledger.evict{'_cold' if cold else ''}_ns_per_block.{label}.{policy}",
                value=ev, unit="ns/block",
                baseline_name="the same reserve into free pages (no eviction)",
                baseline_value=_median([p for _, p in reps[cold]]), better="lower",
                params={"resident_blocks": n, "keys_per_reserve": min(scale.batch, n // 2),
                        "reps": scale.evict_reps, "policy": policy,
                        "caches": "cold" if cold else "warm", "gc": "frozen, off while timed"},
                note="reserve that evicts one unreferenced block per new key, per block "
                     "(median of reps)" + (", caches flushed before each" if cold else "")))
    del small
    for cold in (False, True):
        hi_lo = f"{size_label(hi)}_vs_{size_label(lo)}"
        results.append(Result(
            name=f"ledger.evict{'_cold' if cold else ''}_flatness.{hi_lo}.{policy}",
            value=evict_by_size[(hi, cold)], unit="ns/block",
            baseline_name=f"evict ns/block at {size_label(lo)} resident, measured rep by rep "
                          f"beside the {size_label(hi)} one",
            baseline_value=(_median(beside_hi[cold]) if beside_hi[cold]
                            else evict_by_size[(lo, cold)]),
            better="lower", target="<= 1.5", target_of="ratio",
            params={"sizes": list(scale.sizes), "reps": scale.evict_reps, "policy": policy,
                    "caches": "cold" if cold else "warm"},
            note="eviction must cost the same per block whatever the population (O(1))"
                 + ("; caches flushed at every size, so what is left is the work" if cold
                    else "; warm: a 10k ledger fits in the caches, a 1M one does not")))
    results.append(Result(
        name=f"ledger.memory_bytes_per_block.{size_label(scale.memory_blocks)}.{policy}",
        value=mem_per_block, unit="B/block",
        baseline_name="dict of 32-byte bytes keys -> None (key object + dict slot)",
        baseline_value=dict_bytes, better="lower", target="<= 300", target_of="value",
        params={"resident_blocks": scale.memory_blocks, "method": "tracemalloc delta / blocks",
                "policy": policy},
        note="everything the ledger holds per resident block, keys included"))
    return results


def size_label(n: int) -> str:
    if n % 1_000_000 == 0:
        return f"{n // 1_000_000}M"
    if n % 1000 == 0:
        return f"{n // 1000}k"
    return str(n)
