"""Smoke test of `kvkeeper bench ttft --quick` (vLLM's CPU build; a minute or two).

Runs the benchmark end to end: a daemon, five vLLM engines (recompute, two
with KVKeeperConnector, one with vLLM's ExampleConnector, one with vLLM's own
prefix cache: the floor), warm-ups and two repetitions, on the quick matrix
(model m1 at 512 tokens). Asserts the JSON shape, the names of the matrix's
results and that every hit was verified (the benchmark fails when one did
not happen). No timing is asserted.
"""
from __future__ import annotations

import json
import math
import subprocess
import sys

import pytest

from connector_harness import vllm_unavailable

pytestmark = pytest.mark.skipif(vllm_unavailable() is not None,
                                reason=vllm_unavailable() or "")

KEYS = {"name", "group", "value", "unit", "baseline_name", "baseline_value", "ratio", "better",
        "target", "target_of", "meets_target", "params", "note"}
CASE = "m1.512"   # --quick: model m1 at 512 tokens
# result -> the target issue 12 sets (None: informational)
TARGETS = {
    "full_hit.kvkeeper_vs_floor": "<= 1.15",
    "full_hit.kvkeeper_vs_example_connector": "<= 0.7",
    "full_hit.kvkeeper_p90_vs_median": "<= 1.3",
    "partial_hit.kvkeeper_vs_vllm_prefix_cache": "<= 1.1",
    "full_hit.kvkeeper_vs_recompute": None,
    "floor.vllm_prefix_cache_vs_recompute": None,
    "full_hit.example_connector_vs_recompute": None,
    "partial_hit.kvkeeper_vs_recompute": None,
    "miss.kvkeeper_vs_recompute": None,
    "full_hit.connector_cost.kvkeeper_vs_example_connector": None,
    "full_hit.peer_vs_host": None,
    "full_hit.peer_vs_recompute": None,
}


def run_cli(*args: str) -> subprocess.CompletedProcess:
    # Through the CLI, in a subprocess: what a user runs, and vLLM stays out
    # of the test process.
    return subprocess.run([sys.executable, "-m", "kvkeeper.server.cli", "bench", "ttft", *args],
                          capture_output=True, text=True, timeout=1200)


def test_ttft_model_that_is_no_config_is_a_usage_error(tmp_path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text('{"hidden_size": 768}')
    r = run_cli("--quick", "--json", "--model", str(bad))
    assert r.returncode == 2, r.stderr
    assert "num_hidden_layers" in r.stderr and str(bad) in r.stderr
    assert r.stdout == ""


def test_ttft_quick_json_shape_and_verified_hits() -> None:
    r = run_cli("--quick", "--json")
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-6000:]}"
    items = json.loads(r.stdout)
    by = {i["name"]: i for i in items}
    # The verification row: every check of the timed repetitions passed.
    v = by.pop(f"ttft.{CASE}.verification.failed_checks")
    assert v["value"] == 0 and v["baseline_value"] > 0 and v["target"] == "<= 0"
    assert v["meets_target"] is True and v["params"]["problems"] == []
    items = [i for i in items if i["name"] in by]
    assert set(by) == {f"ttft.{CASE}.{n}" for n in TARGETS}
    for i in items:
        assert set(i) == KEYS, i
        assert i["group"] == "ttft" and i["unit"] == "s" and i["better"] == "lower"
        assert isinstance(i["value"], float) and math.isfinite(i["value"]) and i["value"] > 0
        assert isinstance(i["baseline_value"], float) and i["baseline_value"] > 0
        assert i["ratio"] == pytest.approx(i["value"] / i["baseline_value"])
        assert i["target"] == TARGETS[i["name"].removeprefix(f"ttft.{CASE}.")], i["name"]
        if i["target"] is None:
            assert i["meets_target"] is None
        else:
            assert isinstance(i["meets_target"], bool)
        p = i["params"]
        assert p["case"] == CASE and p["prompt_tokens"] == 512 and p["hit_verified"] is True
        assert p["reps"] == 2 and len(p["samples"]) == 2
        assert p["model_source"] == "M1" and "1 layer(s)" in p["model"]
        load = p["machine_load"]
        assert load["seconds"] > 0 and "cpu_seconds_of_other_processes" in load
        assert set(p["greedy_tokens_identical_to_recompute"]) == {
            "kvk_full", "example_full", "kvk_partial", "prefix_partial"}

    def params(name: str) -> dict:
        return by[f"ttft.{CASE}.{name}"]["params"]

    full, floor = params("full_hit.kvkeeper_vs_recompute"), params("full_hit.kvkeeper_vs_floor")
    # 512-token prompts, blocks of 32: kvkeeper loads all 16 blocks and vLLM
    # computes the last token only; ExampleConnector computes the last block;
    # vLLM's own cache holds all 512 tokens of the prompt it served.
    assert full["hit_tokens"] == 511 and full["example_hit_tokens"] == 480
    assert floor["floor_hit_tokens"] == 512
    assert full["loaded_bytes"] == 16 * 32 * full["kv_bytes_per_token"]
    assert len(full["baseline_samples"]) == 4, "both recompute requests of each repetition"
    assert len(floor["baseline_samples"]) == 2, "the floor of each repetition"
    for i in items:   # the medians and p90s come from the samples reported beside them
        p = i["params"]
        if "p90" in p:
            assert p["p90"] >= i["value"] and p["baseline_p90"] >= i["baseline_value"]
            # (samples are rounded to 10 us, medians to 1 us)
            assert min(p["samples"]) - 1e-5 <= i["value"] <= max(p["samples"]) + 1e-5
    spread = by[f"ttft.{CASE}.full_hit.kvkeeper_p90_vs_median"]
    assert spread["baseline_value"] == pytest.approx(by[f"ttft.{CASE}.full_hit.kvkeeper_vs_floor"]
                                                     ["value"])
    assert spread["value"] >= spread["baseline_value"]
    peer = params("full_hit.peer_vs_host")
    assert peer["hit_sources"] == {"p2p": 511} and peer["hit_tokens"] == 511
    part = params("partial_hit.kvkeeper_vs_vllm_prefix_cache")
    assert part["shared_prefix_tokens"] == 384 and part["hit_tokens"] == 384
    assert part["vllm_prefix_cache_hit_tokens"] == 384
    bd = floor["kvkeeper_breakdown_s"]
    for k in ("ttft", "lookup", "load", "load.fetch", "load.copy", "load.check", "forward",
              "handoff.to_worker", "handoff.worker", "handoff.to_scheduler"):
        assert k in bd, bd
    assert "load" in params("full_hit.kvkeeper_vs_example_connector")["example_breakdown_s"]
