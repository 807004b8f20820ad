"""The ttft matrix's verification, without engines: a round whose kvkeeper hit
loaded the wrong thing (hit tokens, blocks, greedy tokens) fails the case."""
from __future__ import annotations

import copy
from typing import Any, Dict

import pytest

from kvkeeper.connector.bench.ttft_checks import check_round, fail_results
from kvkeeper.connector.bench.ttft_matrix import Case, Hits, Scale, matrix
from kvkeeper.connector.bench.ttft_results import results
from kvkeeper.connector.bench.verify import load_counters_problem

CASE = Case(matrix(quick=True)[0], 512)
HITS = Hits.of(CASE)


def good_round(tok: int = 5) -> Dict[str, Any]:
    """A round as Bench.round returns it, where every check holds."""
    def res(cached: int = 0, hit: Any = None, blocks: int = 0, tokens: Any = None,
            source: str = "host") -> Dict:
        timings = [{"event": "lookup", "dur": 0.001}]
        if blocks:
            timings.append({"event": "load", "dur": 0.002, "blocks": blocks})
        params = None if hit is None else {"kvkeeper": {"hit_tokens": hit}}
        if hit:
            params["kvkeeper"]["hit_sources"] = {source: hit}
        return {"ttft": 0.05, "wall": 0.06, "cached": cached, "params": params,
                "timings": timings, "tokens": [tok] if tokens is None else tokens}
    return {"recompute_full": res(), "recompute_partial": res(tokens=[tok + 1]),
            "kvk_full": res(hit=HITS.full, blocks=HITS.full_blocks),
            "kvk_partial": res(hit=HITS.partial, blocks=HITS.partial // 32, tokens=[tok + 1]),
            "kvk_miss": res(hit=0), "kvk_save_src": res(hit=0),
            "peer_src": res(hit=0, tokens=[tok + 3]),
            "peer_full": res(hit=HITS.full, blocks=HITS.full_blocks, tokens=[tok + 3],
                             source="p2p"),
            "peer_host": res(hit=HITS.full, blocks=HITS.full_blocks),
            "example_save": res(), "example_full": res(cached=HITS.example_full),
            "prefix_served": res(), "prefix_src": res(),
            "prefix_floor": res(cached=HITS.floor),
            "prefix_partial": res(cached=HITS.partial, tokens=[tok + 2])}


def test_a_good_round_passes_every_check() -> None:
    c = check_round(good_round(), HITS)
    assert c.problems == [] and c.count == 20


def spoil(r: Dict[str, Any], how: str) -> None:
    if how == "hit_tokens":
        r["kvk_full"]["params"]["kvkeeper"]["hit_tokens"] = HITS.full - 32
    elif how == "no_report":
        r["kvk_partial"]["params"] = None
    elif how == "blocks":
        r["kvk_full"]["timings"][-1]["blocks"] = HITS.full_blocks - 1
    elif how == "no_load":
        r["kvk_partial"]["timings"] = r["kvk_partial"]["timings"][:1]
    elif how == "greedy_full":
        r["kvk_full"]["tokens"] = [4]
    elif how == "greedy_partial":
        r["kvk_partial"]["tokens"] = [5]
    elif how == "miss_hit":
        r["kvk_miss"]["params"]["kvkeeper"]["hit_tokens"] = 32
    elif how == "floor":
        r["prefix_floor"]["cached"] = HITS.floor - 32
    elif how == "example":
        r["example_full"]["cached"] = 0
    elif how == "peer_from_host":
        r["peer_full"]["params"]["kvkeeper"]["hit_sources"] = {"host": HITS.full}
    elif how == "peer_greedy":
        r["peer_full"]["tokens"] = [1]
    elif how == "recompute_cached":
        r["recompute_partial"]["cached"] = 64
    else:
        raise AssertionError(how)


@pytest.mark.parametrize("how, words", [
    ("hit_tokens", "kvkeeper full hit"), ("no_report", "no kvkeeper report"),
    ("blocks", "loaded"), ("no_load", "loaded 0 blocks"),
    ("greedy_full", "greedy tokens [4] differ from recompute's [5]"),
    ("greedy_partial", "partial hit (kvk-b): greedy tokens [5] differ"),
    ("miss_hit", "must miss"), ("floor", "the floor"), ("example", "ExampleConnector"),
    ("recompute_cached", "recompute"),
    ("peer_from_host", "peer hit (engine peer): hit sources {'host'"),
    ("peer_greedy", "peer hit (engine peer): greedy tokens [1]"),
])
def test_each_wrong_hit_is_one_problem(how: str, words: str) -> None:
    r = good_round()
    spoil(r, how)
    c = check_round(r, HITS)
    assert len(c.problems) == 1 and words in c.problems[0] and c.count == 20


def test_vllms_own_greedy_tokens_are_reported_not_required() -> None:
    r = good_round()
    r["example_full"]["tokens"] = [99]
    r["prefix_partial"]["tokens"] = [99]
    assert check_round(r, HITS).problems == []


def case_results(rounds: list, spoilt: bool) -> list:
    from kvkeeper.connector.bench.ttft_checks import Checks
    checks = Checks()
    for r in rounds:
        checks.extend(check_round(r, HITS))
    return fail_results(results(rounds, CASE, Scale.for_mode(False), HITS, None), checks,
                        CASE.name)


def test_a_failed_check_fails_every_target_of_the_case() -> None:
    # ratios that would all meet their targets: kvkeeper far below every baseline
    rounds = []
    for i in range(9):
        r = good_round()
        for k in ("recompute_full", "recompute_partial", "example_full", "prefix_floor",
                  "prefix_partial"):
            r[k]["ttft"] = 1.0
        rounds.append(r)
    ok = case_results(copy.deepcopy(rounds), False)
    targeted = [x for x in ok if x.target is not None]
    assert len(targeted) == 5 and all(x.meets_target for x in targeted)
    assert all(x.params["hit_verified"] is True for x in ok[:-1])
    ver = ok[-1]
    assert ver.name == "ttft.m1.512.verification.failed_checks"
    assert ver.value == 0 and ver.baseline_value == 9 * 20 and ver.meets_target

    spoil(rounds[4], "greedy_full")
    bad = case_results(rounds, True)
    targeted = [x for x in bad if x.target is not None]
    assert len(targeted) == 5 and not any(x.meets_target for x in targeted)
    assert bad[-1].value == 1 and not bad[-1].meets_target
    assert all(x.params["hit_verified"] is False for x in bad[:-1])
    assert "differ from recompute's" in bad[0].params["verification_problems"][0]
    # the figures themselves are still the measured ones
    assert [x.value for x in bad] == [x.value for x in ok][:-1] + [1.0]


def test_load_counters_must_grow_by_the_loaded_blocks_and_no_error() -> None:
    before = {"vllm:kvkeeper_loaded_blocks": 10.0}
    assert load_counters_problem("kvk-b", before, {"vllm:kvkeeper_loaded_blocks": 26.0},
                                 16) is None
    assert "expected +16" in load_counters_problem(
        "kvk-b", before, {"vllm:kvkeeper_loaded_blocks": 25.0}, 16)
    assert "checksum_errors +1" in load_counters_problem(
        "kvk-b", before, {"vllm:kvkeeper_loaded_blocks": 26.0,
                          "vllm:kvkeeper_checksum_errors": 1.0}, 16)


def test_breakdown_carries_vllms_stages_and_the_lookup_calls() -> None:
    from kvkeeper.connector.bench.phases import breakdown
    r = good_round()
    r["kvk_full"]["stages"] = {"submit": 0.001, "queue": 0.006, "step": 0.04, "out": 0.003}
    r["kvk_full"]["timings"] = [{"event": "lookup", "dur": 0.005, "pending": True},
                                {"event": "lookup", "dur": 0.002},
                                {"event": "load", "dur": 0.01, "blocks": 16, "copy": 0.008},
                                {"event": "step", "forward": 0.02, "save": 0.0}]
    bd = breakdown([r], "kvk_full")
    assert bd["stage.queue"] == 0.006 and bd["stage.step"] == 0.04
    assert bd["lookup_calls"] == 2 and bd["lookup"] == pytest.approx(0.007)
    assert bd["load.copy"] == 0.008 and bd["forward"] == 0.02
    assert bd["other"] == pytest.approx(0.05 - 0.007 - 0.01 - 0.02)


def test_breakdown_times_the_handoffs_between_the_engines_processes() -> None:
    from kvkeeper.connector.bench.phases import breakdown, handoffs
    lines = [{"event": "lookup", "dur": 0.002, "at": 5.000},
             {"event": "meta", "dur": 0.0001, "at": 5.001},
             {"event": "bind", "at": 5.004},
             {"event": "load", "dur": 0.008, "blocks": 16, "at": 5.020},
             {"event": "worker_out", "at": 5.021},
             {"event": "output", "dur": 0.0001, "at": 5.023},
             {"event": "meta", "dur": 0.0001, "at": 5.030}]   # a later step: not this one's
    assert handoffs(lines) == pytest.approx({"handoff.to_worker": 0.003,
                                             "handoff.worker": 0.017,
                                             "handoff.to_scheduler": 0.002})
    assert handoffs([{"event": "bind", "at": 1.0}, {"event": "meta", "at": 2.0}]) == {}
    r = good_round()
    r["kvk_full"]["timings"] = lines
    assert breakdown([r], "kvk_full")["handoff.to_worker"] == pytest.approx(0.003)


def test_stages_cut_a_requests_ttft_at_vllms_timestamps() -> None:
    from types import SimpleNamespace

    from kvkeeper.connector.bench.engine import stages
    m = SimpleNamespace(queued_ts=10.002, scheduled_ts=10.010, first_token_ts=10.040)
    st = stages(m, sent=10.0, ttft=0.045)
    assert st == pytest.approx({"submit": 0.002, "queue": 0.008, "step": 0.03, "out": 0.005})
    assert stages(SimpleNamespace(queued_ts=0.0, scheduled_ts=1.0, first_token_ts=2.0),
                  sent=0.5, ttft=1.0) == {}
    assert stages(None, sent=0.0, ttft=1.0) == {}
