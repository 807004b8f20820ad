"""`kvkeeper experiment prefix` and `report` against the fake OpenAI-compatible
server (fake_openai.py): dry run, real backend, restarts and swap, counters
read from /metrics and checked against the fake's own bookkeeping, missing
metrics, failed requests, an unusable backend."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict, List

import pytest
from fake_openai import FakeServer

from kvkeeper.server.cli import main as cli_main
from kvkeeper.server.experiment import prefix, report
from kvkeeper.server.experiment import metrics_text as mt

SEED_FIELDS = ("schema_version", "environment", "workload", "baseline", "candidate",
               "metrics_artifacts", "failure", "evidence_level", "decision")


def real(fake: FakeServer, out: Path, *extra: str) -> Dict[str, Any]:
    rc, path = prefix.run(["--mode", "real-backend", "--backend-url", fake.url, "--out", str(out),
                           "--num-prompts", "6", "--concurrency", "3", "--max-tokens", "8",
                           "--prefix-words", "120", "-q", "--settle-seconds", "0", *extra])
    assert path == out / "result.json"
    result = json.loads(path.read_text())
    result["_rc"] = rc
    return result


def prompts(out: Path, run: Dict[str, Any]) -> List[str]:
    return [json.loads(line)["prompt"] for line in (out / run["workload"]).read_text().splitlines()]


def served_sum(fake: FakeServer, out: Path, run: Dict[str, Any], key: str) -> int:
    """What the fake itself counted for the prompts of one run."""
    return sum(fake.state.served[p][key] for p in prompts(out, run))


def test_dry_run_writes_plan_and_workloads_and_sends_nothing(tmp_path: Path, capsys: Any) -> None:
    with FakeServer() as fake:
        rc = cli_main(["experiment", "prefix", "--backend-url", fake.url, "--out", str(tmp_path),
                       "--swap", "--restart-cmd", fake.restart_cmd])
        assert rc == 0
        assert fake.state.completions == 0 and fake.state.generation == 0
    result = json.loads((tmp_path / "result.json").read_text())
    for f in SEED_FIELDS:
        assert f in result
    assert result["run_mode"] == "dry_run" and result["evidence_level"] == "dry_run"
    assert result["decision"] == "not_measured" and result["runs"] == []
    assert [(r["pass"], r["arm"], r["restart_before"]) for r in result["plan"]] == [
        (1, "baseline", False), (1, "candidate", True), (2, "candidate", True), (2, "baseline", True)]
    files = result["workload"]["files"]
    assert set(files) == {"pass1_unique", "pass1_shared", "pass2_unique", "pass2_shared"}
    for key, f in files.items():
        rows = [json.loads(x) for x in (tmp_path / f["path"]).read_text().splitlines()]
        assert len(rows) == f["requests"] == 12 and {r["max_tokens"] for r in rows} == {32}
        assert f["distinct_prefixes"] == (12 if key.endswith("unique") else 1)
    out = capsys.readouterr().out
    assert "plan:" in out and "after --restart-cmd" in out


def test_real_backend_figures_and_counters(tmp_path: Path, capsys: Any) -> None:
    with FakeServer() as fake:
        result = real(fake, tmp_path, "--daemon-metrics-url", fake.daemon_metrics_url)
        assert result["_rc"] == 0
        for f in SEED_FIELDS:
            assert f in result
        assert result["run_mode"] == "real_backend" and result["failure"] is None
        assert result["evidence_level"] == "backend_mechanism_benchmark"
        assert result["decision"] == "tune"
        assert result["workload"]["model_id"] == "fake/model-7b"
        assert result["environment"]["backend_version"] == "0.0-fake"
        base, cand = result["runs"]
        assert result["baseline"]["arm"] == "baseline" and "requests_detail" not in result["baseline"]
        for run in (base, cand):
            assert run["requests"] == run["ok"] == 6 and run["failed"] == 0
            assert run["output_tokens"] == 6 * 8
            for m in ("ttft_s", "tpot_s", "e2e_s"):
                d = run["metrics"][m]
                assert d["n"] == 6 and 0 < d["p50"] <= d["p90"] <= d["max"]
            assert run["throughput"]["requests_per_s"] > 0
            assert run["throughput"]["output_tokens_per_s"] == pytest.approx(
                run["throughput"]["requests_per_s"] * 8)
            for rec in run["requests_detail"]:
                assert rec["ttft_s"] <= rec["e2e_s"] and rec["output_tokens"] == 8
            # the deltas are what the fake counted for exactly these prompts
            c = run["counters"]
            assert c[mt.VLLM_PREFIX_HITS] == served_sum(fake, tmp_path, run, "local_tokens")
            assert c[mt.VLLM_PREFIX_QUERIES] == served_sum(fake, tmp_path, run, "prompt_tokens")
            assert c[mt.CONNECTOR_HIT_TOKENS] == served_sum(fake, tmp_path, run, "ext_tokens")
            assert c[mt.DAEMON_HIT_BLOCKS] == served_sum(fake, tmp_path, run, "ext_blocks")
            assert c[mt.DAEMON_HIT_TOKENS] == served_sum(fake, tmp_path, run, "ext_tokens")
        assert base["counters"][mt.VLLM_PREFIX_HITS] == 0 < cand["counters"][mt.VLLM_PREFIX_HITS]
        # the fake does not export vllm:external_prefix_cache_hits_total
        assert cand["counters"][mt.VLLM_EXTERNAL_HITS] == mt.UNAVAILABLE
        assert "does not export" in cand["counters_unavailable"][mt.VLLM_EXTERNAL_HITS]
    # raw snapshots: before, between, after, each of vLLM and of the daemon
    arts = result["metrics_artifacts"]
    assert arts["before"]["name"] == "run1_baseline_pre" and arts["after"]["name"] == "run2_candidate_post"
    assert [s["name"] for s in arts["between"]] == ["run1_baseline_post", "run2_candidate_pre"]
    for snap in [arts["before"], *arts["between"], arts["after"]]:
        for who in ("vllm", "daemon"):
            text = (tmp_path / snap[who]["path"]).read_text()
            assert snap[who]["ok"] and ("vllm:prefix_cache_hits_total" in text if who == "vllm"
                                        else "kvkeeper_hit_blocks_total" in text)
    out = capsys.readouterr().out
    assert "baseline (unique)" in out and "candidate (shared)" in out and "TTFT p50 ms" in out


def test_swap_with_restarts(tmp_path: Path) -> None:
    with FakeServer(unready_polls=2) as fake:
        result = real(fake, tmp_path, "--swap", "--restart-cmd", fake.restart_cmd,
                      "--daemon-metrics-url", fake.daemon_metrics_url)
        assert result["_rc"] == 0 and result["failure"] is None
        assert fake.state.generation == 3                  # before runs 2, 3 and 4
    runs = result["runs"]
    assert [(r["pass"], r["arm"]) for r in runs] == [
        (1, "baseline"), (1, "candidate"), (2, "candidate"), (2, "baseline")]
    assert "restart" not in runs[0]
    for r in runs[1:]:
        assert r["restart"]["mode"] == "command" and r["restart"]["ready_after_seconds"] >= 0
    # the fake refuses requests until it has answered its readiness probes: none failed
    assert all(r["failed"] == 0 and r.get("warmup_failed") == 0 for r in runs)
    assert result["swapped"]["candidate"]["index"] == 3
    assert set(result["comparison"]) == {"pass1", "pass2"}
    # pass 2's prompts are new: no hit from pass 1, neither vLLM's nor the daemon's
    assert runs[3]["counters"][mt.CONNECTOR_HIT_TOKENS] == 0
    assert runs[3]["counters"][mt.VLLM_PREFIX_HITS] == 0


def test_missing_metrics_are_unavailable(tmp_path: Path) -> None:
    with FakeServer(omit={"vllm:prefix_cache_hits_total"}) as fake:
        result = real(fake, tmp_path)           # no --daemon-metrics-url
    for run in result["runs"]:
        assert run["counters"][mt.VLLM_PREFIX_HITS] == mt.UNAVAILABLE
        assert run["counters"][mt.DAEMON_HIT_BLOCKS] == mt.UNAVAILABLE
        assert "no metrics URL" in run["counters_unavailable"][mt.DAEMON_HIT_BLOCKS]
        assert isinstance(run["counters"][mt.CONNECTOR_HIT_TOKENS], int)
    # hits are not inferred from latency: without the hit counter it is latency-only evidence
    assert result["evidence_level"] == "backend_latency_only"
    assert result["metrics_artifacts"]["before"]["daemon"]["ok"] is False
    assert "metrics unavailable" in (tmp_path / result["metrics_artifacts"]["before"]["daemon"]
                                     ["path"]).read_text()


@pytest.mark.parametrize("knob", ["fail_every", "break_every"])
def test_failed_requests_are_counted(tmp_path: Path, knob: str) -> None:
    with FakeServer(**{knob: 4}) as fake:
        result = real(fake, tmp_path, "--warmup", "0")
        injected = fake.state.injected_failures
    failed = sum(r["failed"] for r in result["runs"])
    assert injected == 3 and failed == injected          # completions 4, 8, 12
    assert result["_rc"] == 0 and result["decision"] == "reject_until_failures_fixed"
    run = next(r for r in result["runs"] if r["failed"])
    assert run["ok"] + run["failed"] == run["requests"] == 6
    assert run["metrics"]["ttft_s"]["n"] == run["ok"]
    err = run["failures"][0]["error"]
    assert ("HTTP 500" in err) if knob == "fail_every" else ("[DONE]" in err)


def test_unreachable_backend(tmp_path: Path, capsys: Any) -> None:
    rc, path = prefix.run(["--mode", "real-backend", "--backend-url", "http://127.0.0.1:9",
                           "--out", str(tmp_path), "-q"])
    assert rc == 1
    result = json.loads(path.read_text())
    assert result["failure"]["type"] == "BackendError"
    assert result["evidence_level"] == "failed_real_backend_attempt"
    assert result["decision"] == "reject_until_environment_fixed"
    assert "is the server running?" in capsys.readouterr().err


def test_failing_restart_command(tmp_path: Path) -> None:
    with FakeServer() as fake:
        result = real(fake, tmp_path, "--restart-cmd", "exit 3")
    assert result["_rc"] == 1 and result["failure"]["type"] == "RestartError"
    assert "status 3" in result["failure"]["message"]
    assert len(result["runs"]) == 1 and result["baseline"] is not None and result["candidate"] is None


@pytest.mark.parametrize("argv", [["--num-prompts", "0"], ["--mode", "wet"], ["--warmup", "-1"],
                                  ["--mode", "real-backend", "--backend-url", "ftp://x"]])
def test_usage_errors(tmp_path: Path, argv: List[str]) -> None:
    rc, path = prefix.run([*argv, "--out", str(tmp_path)])
    assert rc == 2 and path is None
    assert list(tmp_path.iterdir()) == []          # nothing written


def test_report_table_and_plot(tmp_path: Path, capsys: Any) -> None:
    with FakeServer() as fake:
        result = real(fake, tmp_path / "r")
    capsys.readouterr()
    assert cli_main(["experiment", "report", str(tmp_path / "r" / "result.json")]) == 0
    out = capsys.readouterr().out
    assert out == report.render({k: v for k, v in result.items() if k != "_rc"})
    assert "pass1: candidate/baseline ttft_p50_ratio" in out
    png = tmp_path / "ttft.png"
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert report.main([str(tmp_path / "r" / "result.json"), "--plot", str(png)]) == 1
        assert "pip install matplotlib" in capsys.readouterr().err
        return
    assert report.main([str(tmp_path / "r" / "result.json"), "--plot", str(png)]) == 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_plot_without_matplotlib(tmp_path: Path, capsys: Any, monkeypatch: Any) -> None:
    import builtins
    real_import = builtins.__import__

    def no_matplotlib(name: str, *a: Any, **k: Any) -> Any:
        if name.startswith("matplotlib"):
            raise ImportError(name)
        return real_import(name, *a, **k)

    path = tmp_path / "result.json"
    path.write_text(json.dumps({"schema_version": "x", "runs": []}))
    monkeypatch.setattr(builtins, "__import__", no_matplotlib)
    assert report.main([str(path), "--plot", str(tmp_path / "p.png")]) == 1
    assert "--plot needs matplotlib: pip install matplotlib" in capsys.readouterr().err


def test_report_bad_file(tmp_path: Path, capsys: Any) -> None:
    path = tmp_path / "x.json"
    path.write_text("[1, 2]")
    assert report.main([str(path)]) == 2
    assert report.main([str(tmp_path / "missing.json")]) == 2
    assert cli_main(["experiment", "nope"]) == 2


def test_restart_command_may_leave_a_server_in_the_background(tmp_path: Path) -> None:
    # A restart command that starts the new server in the background leaves a child
    # holding its stdout; the command's end must not wait for that child's.
    with FakeServer() as fake:
        result = real(fake, tmp_path, "--restart-timeout", "4",
                      "--restart-cmd", f"sleep 8 & {fake.restart_cmd}")
        assert fake.state.generation == 1
    assert result["_rc"] == 0 and result["failure"] is None
