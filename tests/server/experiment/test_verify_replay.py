"""`kvkeeper verify replay` against the fake OpenAI-compatible server
(fake_openai.py): the pass, each failing condition, the restart modes, the
expectation rules, exit codes and the JSON report."""
from __future__ import annotations

import io
import json
import sys
from pathlib import Path
from typing import Any, Dict, List

import pytest
from fake_openai import FakeServer

from kvkeeper.server.cli import main as cli_main
from kvkeeper.server.experiment import metrics_text as mt
from kvkeeper.server.experiment import replay
from kvkeeper.server.experiment.workload import pair, write_jsonl


@pytest.fixture
def prompts(tmp_path: Path) -> Path:
    """6 prompts: 3 sharing one document, 3 with their own (mixed, as in real traffic)."""
    w = pair(3, 6, "replay", prefix_words=70)
    path = tmp_path / "prompts.jsonl"
    write_jsonl(path, w["shared"] + w["unique"])
    return path


def verify(fake: FakeServer, prompts: Path, tmp_path: Path, *extra: str,
           operator: bool = False) -> Dict[str, Any]:
    """Run the check; the fake's restart command unless `operator` or extra names another."""
    out = tmp_path / "report.json"
    argv = ["--backend-url", fake.url, "--prompts", str(prompts), "--out", str(out), "-q",
            "--settle-seconds", "0", *extra]
    if not operator and "--restart-cmd" not in extra:
        argv += ["--restart-cmd", fake.restart_cmd]
    rc, path = replay.run(argv)
    assert path == out
    rep = json.loads(out.read_text())
    rep["_rc"] = rc
    return rep


def conditions(rep: Dict[str, Any]) -> Dict[str, bool]:
    return {c["name"]: c["passed"] for c in rep["conditions"]}


def test_pass(prompts: Path, tmp_path: Path, capsys: Any) -> None:
    with FakeServer(unready_polls=2) as fake:
        rep = verify(fake, prompts, tmp_path, "--daemon-metrics-url", fake.daemon_metrics_url)
        replayed = [fake.state.served[json.loads(x)["prompt"]]
                    for x in prompts.read_text().splitlines()]
        assert fake.state.generation == 1
    assert rep["_rc"] == 0 and rep["verdict"] == "pass" and rep["failed"] == []
    assert conditions(rep) == {"requests": True, "hit_tokens": True, "load_errors": True,
                               "outputs": True}
    assert rep["schema_version"] == "kvkeeper-verify-replay/v1"
    assert rep["block_size"] == {"tokens": 16, "source": "vllm:cache_config_info"}
    assert rep["restart"]["mode"] == "command"
    # the observed rise is the fake's own count for the replay, and the rule expects it
    observed = sum(s["ext_tokens"] for s in replayed)
    assert rep["observed_hit_tokens"] == observed > 0
    assert rep["expected_hit_tokens"]["tokens"] == observed
    assert "token ids from /tokenize" in rep["expected_hit_tokens"]["basis"]
    assert rep["replay"]["counters"][mt.DAEMON_HIT_TOKENS] == observed == rep["daemon_hit_tokens"]
    assert rep["baseline"]["counters"][mt.CONNECTOR_HIT_TOKENS] == 0
    assert len(rep["prompts_detail"]) == 6
    for p in rep["prompts_detail"]:
        assert p["baseline"]["text"] == p["replay"]["text"] != ""
    for name in ("baseline_pre_vllm", "replay_post_vllm", "replay_post_daemon"):
        assert (tmp_path / rep["snapshots"][name]["path"]).read_text().startswith("#")
    out = capsys.readouterr().out
    assert out.startswith("verify replay: PASS") and "[  ok] hit_tokens" in out
    assert f"replay hit tokens: vLLM {observed}, daemon {observed}" in out


def test_daemon_without_disk_tier(prompts: Path, tmp_path: Path) -> None:
    # kvkeeper_disk_checksum_failures_total exists only with a disk tier: not required
    with FakeServer(daemon_disk_tier=False) as fake:
        rep = verify(fake, prompts, tmp_path, "--daemon-metrics-url", fake.daemon_metrics_url)
    assert rep["_rc"] == 0
    detail = next(c["detail"] for c in rep["conditions"] if c["name"] == "load_errors")
    assert mt.DAEMON_DISK_CHECKSUM_FAILURES not in detail
    # a daemon that cannot be scraped at all leaves it unchecked: that fails
    with FakeServer() as fake:
        rep = verify(fake, prompts, tmp_path, "--daemon-metrics-url", "http://127.0.0.1:9/metrics")
    assert rep["failed"] == ["load_errors"]
    detail = next(c["detail"] for c in rep["conditions"] if c["name"] == "load_errors")
    assert f"{mt.DAEMON_DISK_CHECKSUM_FAILURES} unavailable" in detail


def test_no_external_hits_fails_hit_tokens(prompts: Path, tmp_path: Path, capsys: Any) -> None:
    with FakeServer(wipe_store_on_restart=True) as fake:
        rep = verify(fake, prompts, tmp_path)
    assert rep["_rc"] == 1 and rep["failed"] == ["hit_tokens"]
    assert rep["observed_hit_tokens"] == 0
    assert "[FAIL] hit_tokens" in capsys.readouterr().out


def test_no_restart_is_named(prompts: Path, tmp_path: Path) -> None:
    # the "restart" does nothing: vLLM's own cache serves the replay
    with FakeServer() as fake:
        rep = verify(fake, prompts, tmp_path, "--restart-cmd", "true")
    assert rep["failed"] == ["hit_tokens"]
    detail = next(c["detail"] for c in rep["conditions"] if c["name"] == "hit_tokens")
    assert "was the server restarted?" in detail


def test_load_errors_fail(prompts: Path, tmp_path: Path) -> None:
    with FakeServer(load_errors_after_restart=1) as fake:
        rep = verify(fake, prompts, tmp_path)
    assert rep["_rc"] == 1 and rep["failed"] == ["load_errors"]
    detail = next(c["detail"] for c in rep["conditions"] if c["name"] == "load_errors")
    assert f"replay {mt.CONNECTOR_LOAD_ERRORS} +" in detail


def test_different_outputs_fail(prompts: Path, tmp_path: Path) -> None:
    with FakeServer(outputs_change_on_restart=True) as fake:
        rep = verify(fake, prompts, tmp_path)
    assert rep["_rc"] == 1 and rep["failed"] == ["outputs"]
    assert "0/6 identical" in next(c["detail"] for c in rep["conditions"] if c["name"] == "outputs")


def test_failed_requests_fail(prompts: Path, tmp_path: Path) -> None:
    with FakeServer(fail_every=5) as fake:
        rep = verify(fake, prompts, tmp_path, "--expect-hit-tokens", "any")
    assert rep["_rc"] == 1
    assert {"requests", "outputs"} <= set(rep["failed"])
    detail = next(c["detail"] for c in rep["conditions"] if c["name"] == "requests")
    assert "10/12 succeeded" in detail and "HTTP 500" in detail


@pytest.mark.parametrize("missing, failing", [
    ("vllm:kvkeeper_hit_tokens_total", "hit_tokens"),
    ("vllm:kvkeeper_checksum_errors_total", "load_errors")])
def test_unexported_counter_fails_its_condition(prompts: Path, tmp_path: Path, missing: str,
                                                failing: str) -> None:
    with FakeServer(omit={missing}) as fake:
        rep = verify(fake, prompts, tmp_path)
    assert rep["_rc"] == 1 and rep["failed"] == [failing]
    detail = next(c["detail"] for c in rep["conditions"] if c["name"] == failing)
    assert "unavailable" in detail and missing in detail


def test_rules(prompts: Path, tmp_path: Path) -> None:
    with FakeServer() as fake:
        rep = verify(fake, prompts, tmp_path, "--expect-hit-tokens", "100000")
        assert rep["failed"] == ["hit_tokens"] and rep["expected_hit_tokens"]["tokens"] == 100000
    with FakeServer(tokenize=False) as fake:
        # without /tokenize the shared prompts are taken as unrelated: the expectation
        # (usage's prompt token counts, no sharing) is higher than what the replay gets
        rep = verify(fake, prompts, tmp_path)
        assert "assumed to share no block" in rep["expected_hit_tokens"]["basis"]
        assert rep["expected_hit_tokens"]["tokens"] > rep["observed_hit_tokens"] > 0
        assert rep["failed"] == ["hit_tokens"]
        rep = verify(fake, prompts, tmp_path, "--expect-hit-tokens", "any")
        assert rep["_rc"] == 0
    with FakeServer() as fake:
        rep = verify(fake, prompts, tmp_path, "--block-size", "8")
        assert rep["block_size"] == {"tokens": 8, "source": "--block-size"}


def test_operator_restart_by_stdin_and_by_wait(prompts: Path, tmp_path: Path,
                                              monkeypatch: Any) -> None:
    with FakeServer() as fake:
        class Enter(io.StringIO):
            def readline(self, *a: Any) -> str:
                fake.state.restart()          # the operator restarts, then presses Enter
                return "\n"
        monkeypatch.setattr(sys, "stdin", Enter())
        rep = verify(fake, prompts, tmp_path, operator=True)
        assert rep["_rc"] == 0 and rep["restart"]["mode"] == "operator"
        monkeypatch.setattr(sys, "stdin", io.StringIO(""))
        rep = verify(fake, prompts, tmp_path, operator=True)
        assert rep["_rc"] == 1 and rep["failed"] == ["backend"]
        assert "stdin closed" in rep["failure"]["message"]
        rep = verify(fake, prompts, tmp_path, "--wait-seconds", "0", operator=True)
        assert rep["restart"]["mode"] == "wait"
        assert rep["failed"] == ["hit_tokens"]       # nobody restarted it meanwhile


def test_prompts_too_short(tmp_path: Path) -> None:
    path = tmp_path / "short.jsonl"
    path.write_text('{"prompt": "just a few words"}\n')
    with FakeServer() as fake:
        rep = verify(fake, path, tmp_path)
    assert rep["failed"] == ["hit_tokens"]
    assert "fill no block" in rep["conditions"][1]["detail"]


def test_unreachable_backend(prompts: Path, tmp_path: Path) -> None:
    rc, path = replay.run(["--backend-url", "http://127.0.0.1:9", "--prompts", str(prompts),
                           "--restart-cmd", "true", "--out", str(tmp_path / "r.json"), "-q"])
    rep = json.loads(path.read_text())
    assert rc == 1 and rep["failed"] == ["backend"] and rep["verdict"] == "fail"


@pytest.mark.parametrize("argv", [
    ["--prompts", "p.jsonl"], ["--expect-hit-tokens", "most"], ["--max-tokens", "0"],
    ["--wait-seconds", "-1"], ["--wait-seconds", "1", "--restart-cmd", "true"],
    ["--block-size", "0"]])
def test_usage_errors(prompts: Path, argv: List[str], capsys: Any) -> None:
    if "--prompts" not in argv:
        argv = [*argv, "--prompts", str(prompts)]
    rc = cli_main(["verify", "replay", "--backend-url", "http://127.0.0.1:9", *argv])
    assert rc == 2
    assert "verify replay" in capsys.readouterr().err


def test_cli_dispatch_keeps_admin_verify() -> None:
    from kvkeeper.server.cli import build_parser
    args = build_parser().parse_args(["verify"])
    assert args.func.__name__ == "cmd_verify"
