"""kvkeeper.server.experiment's pieces: the metrics text reader, the paired
workloads, percentiles, the replay's expected hit tokens, metric names against
their sources, and that neither vLLM nor the daemon's import path is involved."""
from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from kvkeeper.server.experiment import metrics_text as mt
from kvkeeper.server.experiment.replay import expected_hit_tokens
from kvkeeper.server.experiment.summary import percentile
from kvkeeper.server.experiment.workload import pair, read_jsonl, task, write_jsonl

TEXT = """# HELP vllm:prefix_cache_hits Prefix cache hits.
# TYPE vllm:prefix_cache_hits counter
vllm:prefix_cache_hits_total{engine="0",model_name="a b"} 12.0
vllm:prefix_cache_hits_total{engine="1",model_name="we{i}rd \\"x\\""} 30 1700000000000
vllm:kvkeeper_hit_tokens_total 5
kvkeeper_hit_blocks_total{tier="host"} 3
kvkeeper_hit_blocks_total{tier="disk"} 4
vllm:gauge_nan NaN
vllm:cache_config_info{engine="0",xblock_size="7",block_size="32"} 1.0
garbage line without value
"""


def snap(text: str) -> mt.Snapshot:
    return mt.Snapshot(url="http://x/metrics", text=text, samples=mt.parse(text))


def test_parse_sums_label_sets_and_skips_what_it_cannot_read() -> None:
    s = mt.parse(TEXT)
    assert s["vllm:prefix_cache_hits_total"] == 42.0      # label values with spaces, braces, quotes
    assert s["kvkeeper_hit_blocks_total"] == 7.0
    assert s["vllm:kvkeeper_hit_tokens_total"] == 5.0
    assert "vllm:gauge_nan" not in s and "garbage" not in s


def test_label_value_matches_the_whole_label_name() -> None:
    assert mt.label_value(TEXT, "vllm:cache_config_info", "block_size") == "32"
    assert mt.label_value(TEXT, "vllm:cache_config_info", "num_gpu_blocks") is None
    assert mt.label_value(TEXT, "vllm:missing", "block_size") is None


def test_delta_and_why_unavailable() -> None:
    before, after = snap(TEXT), snap(TEXT.replace("} 12.0", "} 20.0").replace(
        "kvkeeper_hit_tokens_total 5", "kvkeeper_hit_tokens_total 2"))
    values, why = mt.deltas(before, after, ["vllm:prefix_cache_hits_total",
                                            "vllm:kvkeeper_hit_tokens_total", "vllm:absent_total"])
    assert values == {"vllm:prefix_cache_hits_total": 8, "vllm:kvkeeper_hit_tokens_total": mt.UNAVAILABLE,
                      "vllm:absent_total": mt.UNAVAILABLE}
    assert "counter reset" in why["vllm:kvkeeper_hit_tokens_total"]
    assert "does not export vllm:absent_total" in why["vllm:absent_total"]
    down = mt.Snapshot(url="http://x/metrics", error="ConnectionRefusedError: refused")
    assert mt.delta(down, after, "vllm:prefix_cache_hits_total") == mt.UNAVAILABLE
    assert "before: ConnectionRefusedError" in mt.why_unavailable(down, after, "x")
    assert down.raw().startswith("# metrics unavailable from http://x/metrics")


def test_fetch_failure_is_kept_not_raised() -> None:
    s = mt.fetch("http://127.0.0.1:9/metrics", timeout=2)
    assert not s.ok and s.value("anything") is None
    assert mt.fetch(None).error == "no metrics URL given"


@pytest.mark.parametrize("url, want", [
    ("http://h:1", "http://h:1/metrics"), ("h:1", "http://h:1/metrics"),
    ("http://h:1/", "http://h:1/metrics"), ("http://h:1/custom/m", "http://h:1/custom/m")])
def test_metrics_url(url: str, want: str) -> None:
    assert mt.metrics_url(url) == want


def test_workloads_differ_only_in_the_prefix(tmp_path: Path) -> None:
    w = pair(6, 32, "t-p1", prefix_words=120)
    unique, shared = w["unique"], w["shared"]
    assert len(unique) == len(shared) == 6
    assert {r.max_tokens for r in unique + shared} == {32}
    for i, (u, s) in enumerate(zip(unique, shared)):
        assert u.prompt.endswith("\n\n" + task(i)) and s.prompt.endswith("\n\n" + task(i))
        # the same number of words before the task
        assert len(u.prompt.split("\n\n")[0].split()) == len(s.prompt.split("\n\n")[0].split())
    docs_u = [r.prompt.split("\n\n")[0] for r in unique]
    docs_s = {r.prompt.split("\n\n")[0] for r in shared}
    assert len(docs_s) == 1 and len(set(docs_u)) == 6
    # unique documents differ within the first few words, so no block is shared
    assert len({" ".join(d.split()[:4]) for d in docs_u}) == 6
    # deterministic, and another pass tag gives new prompts
    assert pair(6, 32, "t-p1", prefix_words=120) == w
    assert not {r.prompt for r in pair(6, 32, "t-p2", 120)["shared"]} & {r.prompt for r in shared}
    path = tmp_path / "w.jsonl"
    write_jsonl(path, shared)
    assert read_jsonl(path, 8) == shared
    assert {r.max_tokens for r in read_jsonl(path, 8, override_max_tokens=5)} == {5}


def test_default_prompts_span_many_blocks() -> None:
    # 400 words: with a typical tokenizer (>= 1 token a word) more than 12 blocks of 32
    prompt = pair(1, 32, "x")["shared"][0].prompt
    assert len(prompt.split()) >= 12 * 32


@pytest.mark.parametrize("content, fragment", [
    ("", "no prompts"), ("{not json\n", ":1: not JSON"), ('{"text": "a"}\n', '"prompt" string'),
    ('{"prompt": "a", "max_tokens": 0}\n', "positive integer")])
def test_read_jsonl_errors_name_the_line(tmp_path: Path, content: str, fragment: str) -> None:
    path = tmp_path / "p.jsonl"
    path.write_text(content)
    with pytest.raises(ValueError, match=fragment.replace("(", r"\(")):
        read_jsonl(path, 8)


def test_percentile_matches_numpy() -> None:
    np = pytest.importorskip("numpy")
    xs = [0.3, 0.1, 0.9, 0.4, 0.2, 0.75, 0.05]
    for q in (0, 10, 50, 90, 100):
        assert percentile(xs, q) == pytest.approx(float(np.percentile(xs, q)))
    assert percentile([], 50) is None


def test_expected_hit_tokens_rule() -> None:
    b = 4
    # 10 tokens: 2 full blocks -> 8; 8 tokens: exact multiple -> all but the last token = 7
    assert expected_hit_tokens([10, 8], [None, None], b)[0] == 15
    a = list(range(10))
    shared = list(range(8)) + [90, 91]          # shares its first 2 blocks with a
    # the second prompt's shared blocks come from vLLM's own cache in the replay
    assert expected_hit_tokens([10, 10], [a, shared], b)[0] == 8 + 0
    # a duplicate of an exact multiple: vLLM's cache holds all but the last block
    e = list(range(8))
    assert expected_hit_tokens([8, 8], [e, e], b)[0] == 7 + 3
    assert expected_hit_tokens([3], [None], b)[0] == 0
    total, basis = expected_hit_tokens([None], [None], b)
    assert total is None and "unknown" in basis
    assert "assumed to share no block" in expected_hit_tokens([10], [None], b)[1]


def test_connector_counter_names_match_connector_stats() -> None:
    pytest.importorskip("vllm")
    from kvkeeper.connector.stats import COUNTERS
    for name in (mt.CONNECTOR_HIT_TOKENS, mt.CONNECTOR_LOAD_ERRORS, mt.CONNECTOR_LOAD_ERROR_BLOCKS,
                 mt.CONNECTOR_CHECKSUM_ERRORS):
        assert name.startswith("vllm:kvkeeper_") and name.endswith("_total")
        assert name[len("vllm:kvkeeper_"):-len("_total")] in COUNTERS, name


def test_daemon_counter_names_are_exported_by_the_daemon() -> None:
    from kvkeeper.server.ledger import Ledger, LedgerConfig, TierSpec
    from kvkeeper.server.metrics import Metrics
    metrics = Metrics()
    metrics.attach_ledger(Ledger(LedgerConfig(tiers=[TierSpec("host", 64 * 4096, 4096)])),
                          started_at=0.0)
    names = set(mt.parse(metrics.render().decode()))
    assert {mt.DAEMON_HIT_BLOCKS, mt.DAEMON_HIT_TOKENS} <= names


def test_commands_import_neither_vllm_nor_grpc_and_the_daemon_not_them() -> None:
    code = ("import sys, json; import kvkeeper.server.experiment.prefix, "
            "kvkeeper.server.experiment.replay, kvkeeper.server.experiment.report; "
            "print(json.dumps(sorted(m for m in ('vllm', 'torch', 'grpc') if m in sys.modules)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert json.loads(out.stdout) == []
    code = ("import sys; import kvkeeper.server.app, kvkeeper.server.cli; "
            "print([m for m in sys.modules if m.startswith('kvkeeper.server.experiment')])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"
