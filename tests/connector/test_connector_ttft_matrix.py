"""The ttft matrix without engines: its models and lengths, --model configs,
the hits each case implies, and the results computed from rounds of samples.

The rounds here are made up (no vLLM): what is checked is the arithmetic and
the names, not any speed; the engine run is test_connector_bench.py.
"""
from __future__ import annotations

import json
import random

import pytest

from kvkeeper.connector.bench.model import M1, M2, kv_bytes_per_token
from kvkeeper.connector.bench.ttft_matrix import Case, Hits, Scale, matrix
from kvkeeper.connector.bench.ttft_results import results
from kvkeeper.server.bench.registry import BenchUsageError
from kvkeeper.server.bench.result import median, percentile


def test_default_matrix_is_issue_12s() -> None:
    full = matrix(quick=False)
    assert [(m.label, m.lengths) for m in full] == [("m1", (2048,)), ("m2", (2048, 4096))]
    assert full[0].cfg is M1 and full[1].cfg is M2
    # M2: 6 layers, 4 KV heads of 64 dims, fp32: 12 KiB per token, 25 MB per 2048 tokens
    assert kv_bytes_per_token(M2) == 12288 and kv_bytes_per_token(M2) * 2048 == 25165824
    assert kv_bytes_per_token(M1) == 6144
    for m in full:   # room for the floor's prompt plus one token
        assert m.max_model_len > max(m.lengths) <= m.cfg["max_position_embeddings"]
    assert [(m.label, m.lengths) for m in matrix(quick=True)] == [("m1", (512,))]
    assert Scale.for_mode(False).reps >= 9


@pytest.mark.parametrize("n, full, example, shared", [(512, 511, 480, 384),
                                                      (2048, 2047, 2016, 1536),
                                                      (4096, 4095, 4064, 3072)])
def test_hits_of_each_length(n: int, full: int, example: int, shared: int) -> None:
    case = Case(matrix(quick=False)[1], n)
    h = Hits.of(case)
    assert (h.full, h.example_full, h.partial, h.floor) == (full, example, shared, n)
    assert h.full_blocks == n // 32 and case.shared_tokens == shared
    assert case.name == f"m2.{n}"


def test_model_configs_replace_the_matrix(tmp_path) -> None:
    small = tmp_path / "Small Llama.json"
    small.write_text(json.dumps({"hidden_size": 512, "num_hidden_layers": 2,
                                 "num_attention_heads": 8, "vocab_size": 1000,
                                 "max_position_embeddings": 3000}))
    logged = []
    runs = matrix(False, [str(small), str(small)], logged.append)
    assert [(m.label, m.lengths) for m in runs] == [("small-llama", (2048,)),
                                                   ("small-llama-2", (2048,))]
    assert runs[0].cfg["num_key_value_heads"] == 8 and runs[0].cfg["torch_dtype"] == "float32"
    assert runs[0].source == str(small) and "only [2048]" in logged[0]
    assert matrix(True, [str(small)])[0].lengths == (512,)


@pytest.mark.parametrize("text, why", [("{", "cannot read"), ("[1]", "not a JSON object"),
                                       ('{"hidden_size": 768}', "num_hidden_layers"),
                                       ('{"hidden_size": 768, "num_hidden_layers": 1, '
                                        '"num_attention_heads": 7, "vocab_size": 10}',
                                        "multiple"),
                                       ('{"hidden_size": 768, "num_hidden_layers": 1, '
                                        '"num_attention_heads": 12, "vocab_size": 10, '
                                        '"max_position_embeddings": 1024}', "holds none")])
def test_bad_model_configs_are_usage_errors(tmp_path, text: str, why: str) -> None:
    path = tmp_path / "m.json"
    path.write_text(text)
    with pytest.raises(BenchUsageError, match=why):
        matrix(False, [str(path)])


def fake_rounds(reps: int, seed: int = 7) -> list:
    rng = random.Random(seed)
    keys = ("recompute_full", "recompute_partial", "kvk_full", "kvk_partial", "kvk_miss",
            "kvk_save_src", "example_full", "example_save", "prefix_floor", "prefix_partial",
            "peer_full", "peer_host", "peer_src")
    return [{k: {"ttft": rng.uniform(0.01, 2.0), "wall": 1.0, "tokens": [rng.randrange(9)],
                 "timings": [{"event": "lookup", "dur": 0.001},
                             {"event": "load", "dur": 0.002, "blocks": 16}]}
             for k in keys} for _ in range(reps)]


def test_results_compare_the_right_samples() -> None:
    case = Case(matrix(quick=True)[0], 512)
    rounds = fake_rounds(9)
    out = results(rounds, case, Scale.for_mode(False), Hits.of(case), None)
    by = {r.name: r for r in out}
    assert len(by) == len(out) == 12 and all(n.startswith("ttft.m1.512.") for n in by)

    def med(key: str) -> float:
        return median([r[key]["ttft"] for r in rounds])

    floor = by["ttft.m1.512.full_hit.kvkeeper_vs_floor"]
    assert floor.value == pytest.approx(med("kvk_full"), abs=1e-6)
    assert floor.baseline_value == pytest.approx(med("prefix_floor"), abs=1e-6)
    assert floor.target == "<= 1.15" and floor.meets_target == (floor.ratio <= 1.15)
    ex = by["ttft.m1.512.full_hit.kvkeeper_vs_example_connector"]
    assert ex.baseline_value == pytest.approx(med("example_full"), abs=1e-6)
    assert ex.target == "<= 0.7"
    spread = by["ttft.m1.512.full_hit.kvkeeper_p90_vs_median"]
    assert spread.value == pytest.approx(percentile([r["kvk_full"]["ttft"] for r in rounds], 90),
                                         abs=1e-6)
    assert spread.baseline_value == floor.value and spread.target == "<= 1.3"
    part = by["ttft.m1.512.partial_hit.kvkeeper_vs_vllm_prefix_cache"]
    assert part.value == pytest.approx(med("kvk_partial"), abs=1e-6)
    assert part.baseline_value == pytest.approx(med("prefix_partial"), abs=1e-6)
    assert part.target == "<= 1.1"
    peer = by["ttft.m1.512.full_hit.peer_vs_host"]
    assert peer.value == pytest.approx(med("peer_full"), abs=1e-6)
    assert peer.baseline_value == pytest.approx(med("peer_host"), abs=1e-6)
    assert peer.target is None
    rec = by["ttft.m1.512.full_hit.kvkeeper_vs_recompute"]
    pooled = [r[k]["ttft"] for k in ("recompute_full", "recompute_partial") for r in rounds]
    assert rec.baseline_value == pytest.approx(median(pooled), abs=1e-6) and rec.target is None
    same = floor.params["greedy_tokens_identical_to_recompute"]
    want = sum(r["kvk_full"]["tokens"] == r["recompute_full"]["tokens"] for r in rounds)
    assert same["kvk_full"] == f"{want}/9"
