"""What every round of the ttft matrix must show, or the case's results fail.

A round (ttft_bench.Bench.round: one dict of request results per engine
request) is checked as a whole; each check that does not hold is a problem
(a line of text). A kvkeeper hit must report the expected hit tokens, its
worker must have loaded the expected blocks, and its greedy tokens must be
the ones recompute gave for the same prompt (a load that put the wrong KV
in place shows there); the baselines must be what they claim (recompute and
the first requests miss, ExampleConnector and vLLM's own cache hit what
they should). vLLM's own hits' greedy tokens are reported beside
recompute's (ttft_results.tokens_identical), not required: they are not
kvkeeper's to get right.

In warm-ups a problem stops the benchmark (a broken set-up, before the long
part); in the timed repetitions the problems are collected, and
fail_results() fails every targeted result of the case with them, and adds
one result counting them (target: none), so that a run with a bad hit can
never show a met target.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence

from kvkeeper.server.bench.result import Result

from .model import BLOCK_TOKENS
from .ttft_matrix import Hits
from .verify import (VerificationError, hits_problem, kvk_hit, loaded_blocks_problem,
                     tokens_problem)

__all__ = ["Checks", "check_round", "fail_results", "sources_problem"]


class Checks:
    """The problems of a case's timed repetitions, and how many checks ran."""

    def __init__(self) -> None:
        self.problems: List[str] = []
        self.count = 0

    def add(self, problem: Optional[str]) -> None:
        self.count += 1
        if problem is not None:
            self.problems.append(problem)

    def extend(self, other: "Checks") -> None:
        self.problems += other.problems
        self.count += other.count


def _kvk_hits(what: str, results: Sequence[Dict[str, Any]], want: int) -> Optional[str]:
    try:
        got = [kvk_hit(r) for r in results]
    except VerificationError as e:
        return f"{what}: {e}"
    return hits_problem(what, got, want)


def check_round(r: Dict[str, Any], hits: Hits) -> Checks:
    """Every check of one round `r` (keys as Bench.round returns them)."""
    c = Checks()
    c.add(_kvk_hits("kvkeeper full hit (kvk-b)", [r["kvk_full"]], hits.full))
    c.add(_kvk_hits("kvkeeper partial hit (kvk-b)", [r["kvk_partial"]], hits.partial))
    c.add(_kvk_hits("kvk-a (fresh prompts, must miss)",
                    [r["kvk_miss"], r["kvk_save_src"], r["peer_src"]], 0))
    c.add(loaded_blocks_problem("kvk-b (full hit)", r["kvk_full"], hits.full, hits.full_blocks))
    c.add(loaded_blocks_problem("kvk-b (partial hit)", r["kvk_partial"], hits.partial,
                                hits.partial // BLOCK_TOKENS))
    c.add(tokens_problem("kvkeeper full hit (kvk-b)", r["kvk_full"]["tokens"],
                         r["recompute_full"]["tokens"]))
    c.add(tokens_problem("kvkeeper partial hit (kvk-b)", r["kvk_partial"]["tokens"],
                         r["recompute_partial"]["tokens"]))
    c.add(_kvk_hits("peer hit (engine peer, from kvk-a's cache)", [r["peer_full"]], hits.full))
    c.add(_kvk_hits("host-tier hit (engine peer)", [r["peer_host"]], hits.full))
    c.add(loaded_blocks_problem("engine peer (peer hit)", r["peer_full"], hits.full,
                                hits.full_blocks))
    c.add(sources_problem("peer hit (engine peer)", r["peer_full"], {"p2p": hits.full}))
    c.add(sources_problem("host-tier hit (engine peer)", r["peer_host"], {"host": hits.full}))
    c.add(tokens_problem("peer hit (engine peer)", r["peer_full"]["tokens"],
                         r["peer_src"]["tokens"]))
    c.add(tokens_problem("host-tier hit (engine peer)", r["peer_host"]["tokens"],
                         r["recompute_full"]["tokens"]))
    cached: Callable[[str], int] = lambda key: int(r[key]["cached"])
    c.add(hits_problem("recompute (no connector, no prefix cache)",
                       [cached("recompute_full"), cached("recompute_partial")], 0))
    c.add(hits_problem("ExampleConnector first request (saves)", [cached("example_save")], 0))
    c.add(hits_problem("ExampleConnector full hit (num_cached_tokens)",
                       [cached("example_full")], hits.example_full))
    c.add(hits_problem("vLLM prefix cache, first requests (fresh prompts)",
                       [cached("prefix_served"), cached("prefix_src")], 0))
    c.add(hits_problem("the floor: vLLM prefix-cache hit of the served prompt "
                       "(num_cached_tokens)", [cached("prefix_floor")], hits.floor))
    c.add(hits_problem("vLLM prefix-cache hit of the shared part (num_cached_tokens)",
                       [cached("prefix_partial")], hits.partial))
    return c


def sources_problem(what: str, res: Dict[str, Any], want: Dict[str, int]) -> Optional[str]:
    """The tiers a hit came from (its report's hit_sources: vLLM's
    CacheHitSource names) must be `want`: a peer hit served by the host
    tier is another figure."""
    got = ((res.get("params") or {}).get("kvkeeper") or {}).get("hit_sources") or {}
    return None if got == want else f"{what}: hit sources {got}, expected {want}"


def fail_results(out: List[Result], checks: Checks, case_name: str) -> List[Result]:
    """`out` plus a result counting the failed checks; with any, every
    targeted result of `out` fails and carries the problems."""
    shown = checks.problems[:20]
    for res in out:
        res.params["hit_verified"] = not checks.problems
        if checks.problems:
            res.params["verification_problems"] = shown
            if res.target is not None:
                res.meets_target = False
    out.append(Result(
        name=f"ttft.{case_name}.verification.failed_checks", value=len(checks.problems),
        unit="checks", baseline_name="checks made (hit tokens, loaded blocks, greedy tokens, "
        "counters)", baseline_value=checks.count, better="lower", target="<= 0",
        target_of="value", params={"problems": shown},
        note="every hit of the timed repetitions verified; any failed check fails every "
             "target of this case"))
    return out
