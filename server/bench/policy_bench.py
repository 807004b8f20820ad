"""Policy benchmark: block hit ratios of each eviction policy on LLM-serving
traces, replayed through the real Ledger, against the offline optimum.

For each traffic mix (policy_trace.MIXES: chat-heavy, rag-heavy, scan-heavy;
or one recorded trace file, --trace) and each capacity point (10%, 20%, 33%
of the trace's re-read working set, in blocks), every policy in POLICIES
replays the trace through a Ledger whose one tier holds that many blocks,
the way the connector drives it:

    match(prompt keys, lease)          the lookup; its leading hits are the hits
    reserve(the keys after the hit,    the prompt's missed blocks and the decode
            parent=the last hit)       blocks, in chunks of 64 keys (prefill steps),
                                       each reserved and committed in turn
    release(lease)                     after the first chunk's reserve, before it
                                       commits (the connector's usual order, the
                                       one that strands blocks)

A save the tier cannot hold (too much pinned or pending) is dropped, as the
connector drops it; so is one the policy's admission turns away (its keys
come back NOT_ADMITTED: a long run of fresh keys on a full tier). The baseline of each result is the offline optimum
(policy_optimum.py, Belady over blocks) at the same capacity on the same
trace, so each ratio is the policy's share of the reachable hit ratio. The
default policy's results carry the issue's target (>= 0.8 of the optimum),
and one result per point compares it with lru (target >= 1.0).

`policy.hinted.*` replays the same traces where each request the trace
marks as its conversation's last turn says so, as the connector does for
kv_transfer_params {"kvkeeper_last_turn": true}: it saves nothing and its
lease is released with last_turn, so the daemon demotes what it read.

Each result also says what share of the cache held dead blocks (no later
lookup reads them; sampled through the replay), and one informational result
per point replays the default policy driven by a client told which blocks
are read again (policy_liveness.py): how much of the gap to the optimum is
holding the dead, and how much the timing of the next reads. Another
(`policy.blind.*`, policy_blind.py) is the optimum that knows when each
conversation's next turn comes but not which conversations ended: how much of
the optimum's lead knowing ends is worth on its own.

--quick: 400 requests per mix (seconds); default: 2000 per mix (~1-2 min).
"""
from __future__ import annotations

import time
from typing import Callable, Mapping, Optional, Sequence

from ..errors import ResourceExhausted
from ..ids import HOST
from ..ledger import Ledger, LedgerConfig, NamespaceDescriptor, TierSpec
from ..ledger.chains import stranded
from ..ledger.policy import DEFAULT_POLICY, POLICIES
from .policy_blind import blind_uses, think_times
from .policy_liveness import DeadShare, last_lookups, live_prefix
from .policy_optimum import min_hits, next_uses
from .policy_trace import MIXES, Request, generate, read_trace, reread_working_set
from .registry import BenchUsageError
from .result import Result

BLOCK_BYTES = 4096
CHUNK = 64
POINTS = (0.10, 0.20, 0.33)
QUICK_REQUESTS = 400
# Samples of the cache's dead share per replay (policy_liveness.DeadShare).
SAMPLES = 100


class Replay:
    """What one policy did with one trace at one capacity."""

    def __init__(self, hits: int, asked: int, dropped: int, stranded: int, seconds: float,
                 refused: int = 0, dead_share: float = 0.0) -> None:
        self.hits, self.asked, self.dropped = hits, asked, dropped
        self.stranded, self.seconds, self.refused = stranded, seconds, refused
        self.dead_share = dead_share

    @property
    def ratio(self) -> float:
        return self.hits / self.asked if self.asked else 0.0


def replay(requests: Sequence[Request], capacity: int, policy: str, *, hints: bool = False,
           told: bool = False, last: Optional[dict[bytes, int]] = None) -> Replay:
    """Drive a Ledger of `capacity` blocks with `requests` (see the module
    docstring). `hints`: a request marked last_turn does what the connector
    does for one (saves nothing, releases its lease with last_turn). `told`:
    the client knows which blocks are read again (policy_liveness: it saves
    only the live part of each chain and discards the leased blocks nobody
    reads again). The dead share of the cache is
    sampled SAMPLES times through the replay (`last`: last_lookups of the
    trace, computed here when not given)."""
    if last is None:
        last = last_lookups(requests)
    key_bytes = len(requests[0].keys[0])
    longest = max(r.prompt_blocks for r in requests)
    led = Ledger(LedgerConfig(tiers=[TierSpec(HOST, capacity * BLOCK_BYTES, BLOCK_BYTES)],
                              policy=policy, key_bytes=key_bytes,
                              max_keys_per_call=max(longest, CHUNK),
                              lease_ttl_s=1e12, reservation_timeout_s=1e12))
    sid = led.register_session("bench", NamespaceDescriptor(
        model_id="bench", block_tokens=16, block_bytes=BLOCK_BYTES), 0.0).id
    blocks = led.session(sid, 0.0).ns.blocks
    dead = DeadShare(last)
    every = max(1, len(requests) // SAMPLES)
    hits = asked = dropped = 0
    t0 = time.perf_counter()
    for t, r in enumerate(requests):
        now = float(t + 1)
        keys = list(r.keys)
        m = led.match(sid, keys[:r.prompt_blocks], lease=True, now=now)
        h = m.matched
        hits += h
        asked += r.prompt_blocks
        lease = m.lease_id
        discard: list[int] = []
        ends = hints and r.last_turn
        if ends:
            keys = keys[:h]                           # a last turn saves nothing
        if told:
            keys = keys[:live_prefix(keys, last, t)]   # the rest: nobody reads it again
            discard = list(range(min(h, len(keys)), h))
        parent = r.keys[h - 1] if h else b""
        for start in range(h, len(keys), CHUNK):
            chunk = keys[start:start + CHUNK]
            try:
                res = led.reserve(sid, chunk, now, parent=parent)
            except ResourceExhausted:
                dropped += len(keys) - start
                break
            if lease is not None:    # released before the first save commits
                led.release(sid, lease, now, discard_indices=discard, last_turn=ends)
                lease = None
            if res.reservation_id is not None:
                led.commit(sid, res.reservation_id, now)
            parent = chunk[-1]
        if lease is not None:
            led.release(sid, lease, now, discard_indices=discard, last_turn=ends)
        if t % every == every - 1:
            dead.sample(blocks, t)
    seconds = time.perf_counter() - t0
    left = sum(1 for ns in led.namespaces.values() for b in ns.blocks.values() if stranded(b))
    led.check_invariants()
    return Replay(hits, asked, dropped, left, seconds, led.top.admission_refused, dead.share)


def _share(name: str, rp: Replay, opt: float, note: str, params: dict) -> Result:
    """A replay's hit ratio against the optimum's; the default policy's
    carries the issue's target."""
    return Result(
        name=name, value=rp.ratio, unit="ratio",
        baseline_name="offline optimum (Belady over blocks, bypass)", baseline_value=opt,
        better="higher", target=">= 0.8" if params["default"] else None, target_of="ratio",
        params={**params, "dropped_saves_blocks": rp.dropped, "not_admitted_blocks": rp.refused,
                "stranded_blocks_left": rp.stranded,
                "dead_share_of_cache": round(rp.dead_share, 4),
                "replay_seconds": round(rp.seconds, 2)},
        note=note)


def run(quick: bool = False, *, log: Callable[[str], None] = lambda s: None,
        trace: Optional[str] = None, seed: int = 1,
        policies: Optional[Sequence[str]] = None, requests: Optional[int] = None,
        mix_changes: Mapping[str, str] = {}) -> list[Result]:
    """`seed` and `mix_changes` (Mix.changed, applied to every mix) check that
    the figures do not hang on one trace."""
    names = list(policies or sorted(POLICIES))
    if trace is not None:
        traces = {"trace": read_trace(trace)}
    else:
        n = requests or (QUICK_REQUESTS if quick else None)
        try:
            mixes = {name: mix.changed(mix_changes) for name, mix in MIXES.items()}
        except ValueError as e:
            raise BenchUsageError(str(e)) from None
        traces = {name: generate(mix.scaled(n) if n else mix, seed) for name, mix in mixes.items()}
    results: list[Result] = []
    for mix, reqs in traces.items():
        ws = reread_working_set(reqs)
        last = last_lookups(reqs)
        last_turns = sum(r.last_turn for r in reqs)
        gaps = think_times(reqs)
        # The future MIN knows, and the one blind to ends: once per trace, not per point.
        uses, blind_use = next_uses(reqs), blind_uses(reqs, gaps=gaps)
        log(f"policy: {mix}: {len(reqs)} requests, {sum(r.prompt_blocks for r in reqs)} "
            f"looked-up blocks, re-read working set {ws} blocks")
        for point in POINTS:
            cap = max(CHUNK * 2, int(ws * point))
            opt_hits, asked = min_hits(reqs, uses, cap)
            opt = opt_hits / asked if asked else 0.0
            got: dict[str, Replay] = {}
            for name in names:
                got[name] = rp = replay(reqs, cap, name, last=last)
                log(f"policy: {mix} {point:.0%} ({cap} blocks) {name}: {rp.ratio:.3f} "
                    f"(optimum {opt:.3f}; dead share of the cache {rp.dead_share:.2f}) "
                    f"in {rp.seconds:.1f}s")
            hinted = {name: replay(reqs, cap, name, hints=True, last=last) for name in names}
            if DEFAULT_POLICY in hinted:
                log(f"policy: {mix} {point:.0%} {DEFAULT_POLICY} with last-turn hints: "
                    f"{hinted[DEFAULT_POLICY].ratio:.3f}")
            told = replay(reqs, cap, DEFAULT_POLICY, told=True, last=last)
            log(f"policy: {mix} {point:.0%} {DEFAULT_POLICY}, told what is read again: "
                f"{told.ratio:.3f} (dead share {told.dead_share:.2f})")
            blind = min_hits(reqs, blind_use, cap)[0] / asked if asked else 0.0
            log(f"policy: {mix} {point:.0%} the optimum blind to ends (knowing think times): "
                f"{blind:.3f}")
            label = f"{mix}.{round(point * 100)}pct"
            params = {"mix": mix, "capacity_blocks": cap, "capacity_of_working_set": point,
                      "working_set_blocks": ws, "requests": len(reqs), "looked_up_blocks": asked,
                      "seed": seed if trace is None else None, "mix_changes": dict(mix_changes)}
            for kind, replays, note in (
                    ("hit_ratio", got, "block hit ratio through the real Ledger; ratio = share "
                                       "of the optimum"),
                    ("hinted", hinted, "the same replay where the requests the trace marks "
                                       "last_turn say so, as the connector does for "
                                       "kv_transfer_params kvkeeper_last_turn: they save "
                                       "nothing and release their lease with last_turn")):
                for name, rp in replays.items():
                    results.append(_share(f"policy.{kind}.{label}.{name}", rp, opt, note, {
                        **params, "policy": name, "default": name == DEFAULT_POLICY,
                        "last_turns": last_turns if kind == "hinted" else 0}))
            results.append(Result(
                name=f"policy.told.{label}.{DEFAULT_POLICY}", value=told.ratio, unit="ratio",
                baseline_name="offline optimum (Belady over blocks, bypass)",
                baseline_value=opt, better="higher",
                params={**params, "policy": DEFAULT_POLICY,
                        "dead_share_of_cache": round(told.dead_share, 4),
                        "untold_ratio": got[DEFAULT_POLICY].ratio if DEFAULT_POLICY in got else None},
                note="analysis, not a policy: the default policy driven by a client that knows "
                     "which blocks are read again (policy_liveness.py); the rest of the gap to "
                     "the optimum is when they are read"))
            results.append(Result(
                name=f"policy.blind.{label}", value=blind, unit="ratio",
                baseline_name="offline optimum (Belady over blocks, bypass)",
                baseline_value=opt, better="higher",
                params={**params, "last_turns": last_turns, "think_times": len(gaps)},
                note="analysis, not a policy: the optimum knowing when each conversation's "
                     "next turn comes but not which ended (an ended one's blocks are held for "
                     "a phantom turn a think time later, policy_blind.py); optimum - blind is "
                     "what knowing ends is worth on top of knowing timing"))
            if DEFAULT_POLICY in got and "lru" in got:
                results.append(Result(
                    name=f"policy.default_vs_lru.{label}", value=got[DEFAULT_POLICY].ratio,
                    unit="ratio", baseline_name="lru's hit ratio on the same replay",
                    baseline_value=got["lru"].ratio, better="higher", target=">= 1.0",
                    target_of="ratio", params={**params, "policy": DEFAULT_POLICY},
                    note="the default policy is never below lru"))
    return results
