"""Ledger benchmark: pure Python, no server, no I/O. Every figure below is
measured for each eviction policy (names end in .<policy>).

For each population N (10k, 100k, 1M resident blocks; 10k and 100k with --quick)
one ledger is built with a single tier whose page equals the block size
(4096 B) and whose capacity is exactly N blocks, then filled through the
public API (reserve + commit, 4096 keys per call, one session with a huge
lease TTL). Then:

* match: `Ledger.match` of a 256-key chain (all present, no lease), at random
  positions, per block. Baseline: the least work any match must do, a loop
  of `dict.get` over the same number of fresh keys on the ledger's own
  namespace dict (same size, same memory layout). Keys are fresh bytes objects
  for both (as they come off the wire), so both pay for hashing.
* evict: with the tier full of unreferenced blocks, a `reserve` of 4096 new
  keys must evict 4096 blocks first; its cost per block is the result.
  Baseline: the same reserve when the pages are free (the evicting
  reservation is aborted, which frees exactly those pages, and 4096 other new
  keys are reserved), at the same N. The difference is the eviction itself.
* evict flatness: evict cost per block at the largest N over the smallest.
  The smallest ledger is kept and measured again rep by rep beside the
  largest, so a change in machine load hits both alike. An O(1) eviction keeps
  this near 1 (cache misses grow a little with N); an O(log N) one would be
  about 1.5 from 10k to 1M, an O(N) one ~100.
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
from typing import Callable, Optional, Sequence

from ..ids import HOST
from ..ledger import Ledger, LedgerConfig, NamespaceDescriptor, TierSpec
from ..ledger.policy import DEFAULT_POLICY, POLICIES
from .result import Result

BLOCK_BYTES = 4096
CHAIN = 256
BATCH = 4096
KEY_BYTES = 32


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
        keys = keys_range(start, min(batch, n - start))
        now = clock()
        res = ledger.reserve(sid, keys, now)
        ledger.commit(sid, res.reservation_id, now)
    return ledger, sid


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

    def evict_once(self) -> tuple[float, float]:
        """(ns/block of a reserve that evicts k blocks, ns/block of a reserve of
        k keys into free pages); leaves the tier full again."""
        ledger, sid, k, tier = self.ledger, self.sid, self.k, self.ledger.top
        perf = time.perf_counter
        if tier.free_pages != 0 or tier.evictable_pages != self.n:
            raise RuntimeError("bench setup: the tier is not full of unreferenced blocks")
        a = keys_range(self.next_key, k)
        b = keys_range(self.next_key + k, k)
        self.next_key += 2 * k
        ev0 = sum(tier.evictions.values())
        now = self.clock()
        t0 = perf()
        res = ledger.reserve(sid, a, now)
        t1 = perf()
        if sum(tier.evictions.values()) - ev0 != k:
            raise RuntimeError("bench setup: the reserve did not evict one block per key")
        ledger.abort(sid, res.reservation_id, now)   # frees exactly k pages
        now = self.clock()
        t2 = perf()
        res = ledger.reserve(sid, b, now)
        t3 = perf()
        ledger.commit(sid, res.reservation_id, now)
        return (t1 - t0) / k * 1e9, (t3 - t2) / k * 1e9


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
    evict_by_size: dict[int, float] = {}
    mem_per_block = 0.0
    sizes = sorted(scale.sizes)
    lo, hi = sizes[0], sizes[-1]
    small: Optional[_Filled] = None     # kept, to be measured again beside the largest
    small_beside_hi: list[float] = []
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
            evicting: list[float] = []
            plain: list[float] = []
            for _ in range(scale.evict_reps):
                ev, pl = filled.evict_once()
                evicting.append(ev)
                plain.append(pl)
                if n == hi and small is not None:
                    small_beside_hi.append(small.evict_once()[0])
            if n <= 100_000:
                ledger.check_invariants()
        finally:
            gc.unfreeze()
        if n == lo:
            small = filled
        del ledger, filled
        gc.collect()
        ev, pl = _median(evicting), _median(plain)
        evict_by_size[n] = ev
        label = size_label(n)
        results.append(Result(
            name=f"ledger.match_ns_per_block.{label}.{policy}", value=m_ledger, unit="ns/block",
            baseline_name="dict.get loop over the same keys", baseline_value=m_dict,
            better="lower", params={"resident_blocks": n, "chain": CHAIN, "chains": scale.chains,
                                    "lease": False, "policy": policy},
            note="Ledger.match of a 256-key chain; the ratio is the ledger's overhead over a bare lookup"))
        results.append(Result(
            name=f"ledger.evict_ns_per_block.{label}.{policy}", value=ev, unit="ns/block",
            baseline_name="the same reserve into free pages (no eviction)", baseline_value=pl,
            better="lower", params={"resident_blocks": n, "keys_per_reserve": min(scale.batch, n // 2),
                                    "reps": scale.evict_reps, "policy": policy},
            note="reserve that evicts one unreferenced block per new key, per block (median of reps)"))
    del small
    results.append(Result(
        name=f"ledger.evict_flatness.{size_label(hi)}_vs_{size_label(lo)}.{policy}",
        value=evict_by_size[hi], unit="ns/block",
        baseline_name=f"evict ns/block at {size_label(lo)} resident, measured rep by rep "
                      f"beside the {size_label(hi)} one",
        baseline_value=_median(small_beside_hi) if small_beside_hi else evict_by_size[lo],
        better="lower", target="<= 1.5", target_of="ratio",
        params={"sizes": list(scale.sizes), "reps": scale.evict_reps, "policy": policy},
        note="eviction must cost the same per block whatever the population (O(1))"))
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
