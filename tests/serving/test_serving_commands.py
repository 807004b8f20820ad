"""`kvkeeper experiment prefix` and `kvkeeper verify replay` in real-backend mode
against the `serving` fixture's `vllm serve` (tiny Llama, CPU build). The replay
check restarts the server through the fixture's restart command; the
experiment does not (both commands restart through the same function, and a
restart costs 35-70 s here: the module stays within ~3 minutes).

Small on purpose (4 prompts, 8 output tokens, one request at a time so the
shared prefix is in vLLM's cache for the next one): it checks the commands
and their JSON on a real server; the figures are not measurements.
"""
from __future__ import annotations

import json
import uuid
from pathlib import Path
from typing import Any, Dict

import pytest

from kvkeeper.server.experiment import metrics_text as mt
from kvkeeper.server.experiment import prefix, replay, report

SEED_FIELDS = ("schema_version", "environment", "workload", "baseline", "candidate",
               "metrics_artifacts", "failure", "evidence_level", "decision")
NUM_PROMPTS = 4
MAX_TOKENS = 8


@pytest.fixture(scope="module")
def experiment(serving: Any) -> Dict[str, Any]:
    out = Path(serving.tmp) / "experiment"
    rc, path = prefix.run([
        "--mode", "real-backend", "--backend-url", serving.url, "--model", serving.model,
        "--num-prompts", str(NUM_PROMPTS), "--concurrency", "1", "--max-tokens", str(MAX_TOKENS),
        "--warmup", "1", "--prefix-words", "200", "--label", f"serving-{uuid.uuid4().hex[:8]}",
        "--out", str(out), "--daemon-metrics-url", serving.metrics_url,
        "--settle-seconds", "1", "-q"])
    assert path is not None
    result = json.loads(Path(path).read_text())
    result["_rc"], result["_out"] = rc, out
    return result


def test_experiment_prefix_on_vllm_serve(experiment: Dict[str, Any]) -> None:
    r = experiment
    assert r["_rc"] == 0, r.get("failure")
    for f in SEED_FIELDS:
        assert f in r, f
    assert r["failure"] is None and r["run_mode"] == "real_backend"
    assert r["evidence_level"] == "backend_mechanism_benchmark" and r["decision"] == "tune"
    base, cand = r["runs"]
    assert (base["arm"], cand["arm"]) == ("baseline", "candidate")
    assert "restart" not in base and "restart" not in cand
    for run in (base, cand):
        assert run["requests"] == run["ok"] == NUM_PROMPTS and run["failed"] == 0
        assert run["warmup_failed"] == 0
        assert run["output_tokens"] == NUM_PROMPTS * MAX_TOKENS
        assert 0 < run["metrics"]["ttft_s"]["p50"] <= run["metrics"]["ttft_s"]["p90"]
        # The server and the daemon export every counter the result names.
        assert run["counters_unavailable"] == {}, run["counters_unavailable"]
        c = run["counters"]
        for name in (mt.CONNECTOR_LOAD_ERRORS, mt.CONNECTOR_CHECKSUM_ERRORS):
            assert c[name] == 0, name
        assert c[mt.VLLM_PREFIX_QUERIES] >= NUM_PROMPTS * 32
    # The shared document is computed once and then found in vLLM's own cache; the
    # unique documents are not. The daemon never saw these prompts (a new label).
    assert cand["counters"][mt.VLLM_PREFIX_HITS] > base["counters"][mt.VLLM_PREFIX_HITS]
    assert cand["counters"][mt.CONNECTOR_HIT_TOKENS] == 0
    arts = r["metrics_artifacts"]
    for snap in [arts["before"], *arts["between"], arts["after"]]:
        assert snap["vllm"]["ok"] and snap["daemon"]["ok"]
        assert mt.CONNECTOR_HIT_TOKENS in (r["_out"] / snap["vllm"]["path"]).read_text()
    # The summary table `kvkeeper experiment report` shows (pytest -s shows it here).
    print("\n" + report.render({k: v for k, v in r.items() if not k.startswith("_")}))
    print(f"\nexperiment prefix on vllm serve: TTFT p50 baseline "
          f"{base['metrics']['ttft_s']['p50']:.3f} s, candidate "
          f"{cand['metrics']['ttft_s']['p50']:.3f} s; vLLM prefix hits +"
          f"{base['counters'][mt.VLLM_PREFIX_HITS]:.0f} / +"
          f"{cand['counters'][mt.VLLM_PREFIX_HITS]:.0f}; daemon hit blocks +"
          f"{base['counters'][mt.DAEMON_HIT_BLOCKS]:.0f} / +"
          f"{cand['counters'][mt.DAEMON_HIT_BLOCKS]:.0f}")


def test_verify_replay_on_vllm_serve(serving: Any, experiment: Dict[str, Any]) -> None:
    # The candidate's prompts: the daemon holds their blocks, and so does vLLM's own
    # cache until the restart; after it they can only come from the daemon.
    prompts = experiment["_out"] / experiment["runs"][1]["workload"]
    out = Path(serving.tmp) / "replay" / "report.json"
    rc, path = replay.run([
        "--backend-url", serving.url, "--model", serving.model, "--prompts", str(prompts),
        "--max-tokens", str(MAX_TOKENS), "--restart-cmd", serving.restart_cmd,
        "--daemon-metrics-url", serving.metrics_url, "--out", str(out),
        "--settle-seconds", "1", "-q"])
    rep = json.loads(out.read_text())
    assert path == out.resolve()
    conds = {c["name"]: c for c in rep["conditions"]}
    assert set(conds) == {"requests", "hit_tokens", "load_errors", "outputs"}
    assert rc == 0 and rep["verdict"] == "pass", [c for c in rep["conditions"] if not c["passed"]]
    assert rep["block_size"] == {"tokens": 32, "source": "vllm:cache_config_info"}
    assert rep["restart"]["mode"] == "command"
    want = rep["expected_hit_tokens"]["tokens"]
    assert want > 0 and rep["observed_hit_tokens"] >= want
    # The daemon counts what vLLM loaded: the same tokens, but for the last-token
    # rule (a full hit of a block-aligned prompt recomputes its last token, which
    # vLLM does not count and the daemon served): at most one token per prompt.
    assert 0 <= rep["daemon_hit_tokens"] - rep["observed_hit_tokens"] <= NUM_PROMPTS
    print(f"\nverify replay on vllm serve: {rep['verdict']}; vllm:kvkeeper_hit_tokens_total "
          f"+{rep['observed_hit_tokens']} (expected >= {want}, "
          f"{rep['expected_hit_tokens']['basis']}), daemon kvkeeper_hit_tokens_total "
          f"+{rep['daemon_hit_tokens']}")
