"""Smoke test of `kvkeeper bench ttft --quick` (vLLM's CPU build; about a minute).

Runs the benchmark end to end: a daemon, four vLLM engines (recompute,
two with KVKeeperConnector, one with vLLM's ExampleConnector), warm-ups and
two repetitions. Asserts the JSON shape and that every hit was verified (the
benchmark fails when one did not happen). No timing is asserted.
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
NAMES = {"ttft.full_hit.kvkeeper_vs_recompute", "ttft.full_hit.kvkeeper_vs_example_connector",
         "ttft.partial_hit.kvkeeper_vs_recompute", "ttft.full_hit.example_connector_vs_recompute",
         "ttft.miss.kvkeeper_vs_recompute",
         "ttft.full_hit.connector_cost.kvkeeper_vs_example_connector"}


def test_ttft_quick_json_shape_and_verified_hits() -> None:
    # Through the CLI, in a subprocess: what a user runs, and vLLM stays out
    # of the test process.
    r = subprocess.run([sys.executable, "-m", "kvkeeper.server.cli", "bench", "ttft", "--quick",
                        "--json"], capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, f"stdout:\n{r.stdout[-3000:]}\nstderr:\n{r.stderr[-6000:]}"
    items = json.loads(r.stdout)
    by = {i["name"]: i for i in items}
    assert set(by) == NAMES
    for i in items:
        assert set(i) == KEYS, i
        assert i["group"] == "ttft" and i["unit"] == "s" and i["better"] == "lower"
        assert isinstance(i["value"], float) and math.isfinite(i["value"]) and i["value"] > 0
        assert isinstance(i["baseline_value"], float) and i["baseline_value"] > 0
        assert i["ratio"] == pytest.approx(i["value"] / i["baseline_value"])
        if i["target"] is None:
            assert i["meets_target"] is None
        else:
            assert isinstance(i["meets_target"], bool)
    assert by["ttft.full_hit.kvkeeper_vs_recompute"]["target"] == "<= 0.1"
    assert by["ttft.full_hit.kvkeeper_vs_example_connector"]["target"] == "<= 0.5"
    assert by["ttft.partial_hit.kvkeeper_vs_recompute"]["target"] is None

    full = by["ttft.full_hit.kvkeeper_vs_recompute"]["params"]
    partial = by["ttft.partial_hit.kvkeeper_vs_recompute"]["params"]
    assert full["hit_verified"] is True and partial["hit_verified"] is True
    # --quick: 512-token prompts, blocks of 32: kvkeeper loads all 16 blocks and
    # vLLM computes the last token only; ExampleConnector computes the last block.
    assert full["prompt_tokens"] == 512 and full["hit_tokens"] == 511
    assert full["example_hit_tokens"] == 480
    assert partial["shared_prefix_tokens"] == 384 and partial["hit_tokens"] == 384
    assert len(full["samples"]) == full["reps"] == 2
    assert len(full["baseline_samples"]) == 4, "both recompute requests of each repetition"
    bd = full["kvkeeper_breakdown_s"]
    for k in ("ttft", "lookup", "load", "load.fetch", "load.copy", "load.check", "forward"):
        assert k in bd, bd
    ex = by["ttft.full_hit.kvkeeper_vs_example_connector"]["params"]
    assert "load" in ex["example_breakdown_s"]
