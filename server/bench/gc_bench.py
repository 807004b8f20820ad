"""GC benchmark: Match latency under churn with 1M resident blocks (100k with
--quick), CPython's default GC against the daemon's GcPolicy (server/ops/gcpolicy.py).

One real Ledger (ledger_bench.build_filled: one tier of exactly N blocks, full)
serves a stream of requests shaped like the daemon's request path: Match of a
256-key chain of recently saved keys with a lease, a save of 1024 new blocks
(reserve + commit in runs of 16 keys, as prefill steps save them, evicting
1024 blocks in the policy's order), Release of the
lease. Both configurations run on the same ledger, alternated phase by phase
(default, policy, default, policy, ...) so that a change in machine load hits
both alike:

* default: gc.unfreeze(), CPython's thresholds as found, no freezing;
* policy: GcPolicy(server.gc_freeze_interval_seconds's default): settle()
  before the phase (collect + freeze, as the daemon does after start-up), then
  tick() every interval of the request clock, as the daemon's reaper does.

Latency is what a client of the daemon's one event loop sees. Requests arrive
on a fixed schedule, one every `gap` seconds (gap = mean service time of a
request measured without GC, over UTILIZATION), and run back to back; each
operation's service time is measured (a collection that starts inside it is
part of it) and the queue is replayed on the schedule (start = max(arrival,
previous end)), so a Match that arrives during a 150 ms collection, or behind
one, waits for it. Ticks run between requests at their place in the schedule
and delay the requests behind them the same way. A Match's latency is its end
minus its arrival. Durations are the thread's CPU time (time.thread_time): the
event loop as it would run on a core of its own, whatever else the machine runs.

The churn is the ledger's alone, at half its capacity (~100k new blocks a
second on a fast core): a daemon that also moves the blocks' bytes churns far
fewer, and a tick's pause, which grows with the blocks created since the
previous tick, is smaller there. What bounds the policy's worst Match is not
the GC: CPython rebuilds the namespace's key dict when its free slots run out
(at 1M keys, ~70 ms every ~400k new keys), in both configurations alike.

Collections are counted with gc.callbacks: `full` is a generation-2 collection
started by CPython inside a request (the default's pause), `tick` one run by
GcPolicy.tick between requests.
"""
from __future__ import annotations

import gc
import random
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

from ..config import ServerSection
from ..ledger import Ledger
from ..ops.gcpolicy import GcPolicy
from .ledger_bench import Clock, build_filled, keys_range, reserve_runs, size_label
from .result import Result, percentile

CHAIN = 256           # keys per Match: a 4k-token prompt at 16 tokens per block
SAVE = 1024           # new blocks per save
FILL_BATCH = 4096
UTILIZATION = 0.5     # share of the schedule the event loop is busy without GC
# Every duration is this thread's CPU time: on a shared machine other processes'
# time slices would otherwise count as the daemon's work (and swamp the replay).
busy = time.thread_time


@dataclass(frozen=True)
class Scale:
    blocks: int           # resident blocks
    requests: int         # requests per phase
    rounds: int           # phases per configuration, alternated
    calibrate: int = 50   # requests timed without GC before each round, to set the gap
    interval_s: Optional[float] = None   # ticks; None: server.gc_freeze_interval_seconds' default

    @classmethod
    def for_mode(cls, quick: bool) -> "Scale":
        if quick:
            return cls(blocks=100_000, requests=250, rounds=2)
        return cls(blocks=1_000_000, requests=1200, rounds=2)


@dataclass
class _Phase:
    """What one configuration saw, summed over its phases."""
    match_latency: list[float] = field(default_factory=list)
    match_service: list[float] = field(default_factory=list)
    full: list[float] = field(default_factory=list)      # seconds of each request-path gen2 pass
    young: int = 0
    ticks: list[float] = field(default_factory=list)     # seconds of each tick's collect + freeze


class _GcWatch:
    """gc.callbacks: each collection's generation and duration, charged to `into`."""

    def __init__(self) -> None:
        self.into: Optional[_Phase] = None
        self.in_tick = False
        self._t0 = 0.0

    def __call__(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = busy()
            return
        if self.into is None or self.in_tick:
            return
        if info["generation"] == 2:
            self.into.full.append(busy() - self._t0)
        else:
            self.into.young += 1


class _Churn:
    """The request stream over one filled ledger."""

    def __init__(self, ledger: Ledger, sid: str, n: int, clock: Clock, rng: random.Random) -> None:
        self.ledger, self.sid, self.n, self.clock, self.rng = ledger, sid, n, clock, rng
        self.next_key = n

    def request(self) -> tuple[float, float]:
        """One request: (Match seconds, save + release seconds)."""
        ledger, sid, perf = self.ledger, self.sid, busy
        # A chain among the newer half of the keys: resident unless recently evicted.
        start = self.rng.randrange(self.next_key - self.n // 2, self.next_key - CHAIN)
        chain = keys_range(start, CHAIN)
        new = keys_range(self.next_key, SAVE)
        self.next_key += SAVE
        t0 = perf()
        m = ledger.match(sid, chain, lease=True, now=self.clock())
        t1 = perf()
        for rid in reserve_runs(ledger, sid, new, self.clock()):
            ledger.commit(sid, rid, self.clock())
        if m.lease_id is not None:
            ledger.release(sid, m.lease_id, self.clock())
        t2 = perf()
        return t1 - t0, t2 - t1


def _calibrate(churn: _Churn, n: int) -> float:
    """Mean service time of one request with the GC off."""
    was = gc.isenabled()
    gc.disable()
    try:
        total = 0.0
        for _ in range(n):
            a, b = churn.request()
            total += a + b
    finally:
        if was:
            gc.enable()
    return total / n


def _run_phase(churn: _Churn, requests: int, gap: float, policy: Optional[GcPolicy],
               watch: _GcWatch, into: _Phase) -> None:
    """`requests` on the schedule; with `policy`, its ticks at their place in it."""
    free = 0.0          # when the replayed event loop is next idle
    watch.into = into
    try:
        for i in range(requests):
            arrival = i * gap
            if policy is not None and policy.due(arrival):
                watch.in_tick = True
                t0 = busy()
                try:
                    report = policy.tick(arrival)
                finally:
                    watch.in_tick = False
                took = busy() - t0
                assert report is not None
                into.ticks.append(took)
                free = max(arrival, free) + took
            d_match, d_rest = churn.request()
            end = max(arrival, free) + d_match
            into.match_latency.append(end - arrival)
            into.match_service.append(d_match)
            free = end + d_rest
    finally:
        watch.into = None


def run(quick: bool = False, *, scale: Optional[Scale] = None,
        log: Callable[[str], None] = lambda s: None, seed: int = 1) -> list[Result]:
    scale = scale or Scale.for_mode(quick)
    if scale.blocks < 4 * (CHAIN + SAVE):
        raise ValueError(f"blocks must be at least {4 * (CHAIN + SAVE)}")
    interval = (ServerSection().gc_freeze_interval_seconds if scale.interval_s is None
                else scale.interval_s)
    rng = random.Random(seed)
    default, tuned = _Phase(), _Phase()
    gaps: list[float] = []
    was_enabled, thresholds = gc.isenabled(), gc.get_threshold()
    watch = _GcWatch()
    policy = GcPolicy(interval)
    log(f"gc: filling {scale.blocks} blocks")
    gc.collect()
    gc.disable()
    try:
        clock = Clock()
        ledger, sid = build_filled(scale.blocks, FILL_BATCH, clock)
    finally:
        gc.enable()
    churn = _Churn(ledger, sid, scale.blocks, clock, rng)
    gc.collect()    # as after the default's start-up: everything built is in gen2
    gc.callbacks.append(watch)
    try:
        for r in range(scale.rounds):
            gap = _calibrate(churn, scale.calibrate) / UTILIZATION
            gaps.append(gap)
            log(f"gc: round {r + 1}/{scale.rounds}: {scale.requests} requests per configuration, "
                f"one every {gap * 1e3:.2f} ms")
            policy.release()
            gc.set_threshold(*thresholds)
            _run_phase(churn, scale.requests, gap, None, watch, default)
            policy.settle(0.0)
            _run_phase(churn, scale.requests, gap, policy, watch, tuned)
    finally:
        gc.callbacks.remove(watch)
        policy.release()
        gc.set_threshold(*thresholds)
        if not was_enabled:
            gc.disable()
    if scale.blocks <= 100_000:
        ledger.check_invariants()
    del churn, ledger
    gc.collect()
    return _results(scale, default, tuned, gaps, interval)


def _results(scale: Scale, default: _Phase, tuned: _Phase, gaps: list[float],
             interval: float) -> list[Result]:
    label = size_label(scale.blocks)
    params: dict[str, Any] = {
        "resident_blocks": scale.blocks, "chain": CHAIN, "save_blocks": SAVE,
        "requests_per_config": scale.requests * scale.rounds, "rounds": scale.rounds,
        "utilization": UTILIZATION, "gap_ms": [round(g * 1e3, 3) for g in gaps],
        "gc_freeze_interval_s": interval,
        "default": _counts(default), "policy": _counts(tuned),
    }
    base_name = "CPython's default GC, same ledger and schedule"
    out = []
    for q, tag in ((50, "p50"), (99, "p99"), (100, "max")):
        out.append(Result(
            name=f"gc.match_{tag}_us.{label}",
            value=percentile(tuned.match_latency, q) * 1e6, unit="us",
            baseline_name=base_name, baseline_value=percentile(default.match_latency, q) * 1e6,
            better="lower", params=params,
            note="Match latency (queueing behind the event loop included) under churn; "
                 "value: the daemon's GcPolicy (collect + freeze after start-up, re-freeze "
                 "every interval)"))
    out.append(Result(
        name=f"gc.longest_pause_ms.{label}",
        value=max(tuned.full + tuned.ticks, default=0.0) * 1e3, unit="ms",
        baseline_name="the default's longest full collection",
        baseline_value=max(default.full, default=0.0) * 1e3,
        better="lower", params=params,
        note="the longest time the event loop stood still for the GC (young collections "
             "not counted): policy = its ticks and any full pass CPython started itself"))
    return out


def _counts(p: _Phase) -> dict[str, Any]:
    return {
        "full_collections_in_requests": len(p.full),
        "longest_full_ms": round(max(p.full, default=0.0) * 1e3, 3),
        "young_collections": p.young,
        "ticks": len(p.ticks),
        "median_tick_ms": round(percentile(p.ticks, 50) * 1e3, 3) if p.ticks else 0.0,
        "longest_tick_ms": round(max(p.ticks, default=0.0) * 1e3, 3),
        "match_service_p99_us": round(percentile(p.match_service, 99) * 1e6, 1),
        "match_service_max_us": round(max(p.match_service) * 1e6, 1),
    }
