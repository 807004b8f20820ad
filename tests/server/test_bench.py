"""Smoke tests of `kvkeeper bench`: each benchmark runs in --quick mode and its
JSON has the documented shape. No timing is asserted: these run on shared CI
machines; the figures themselves are for people to read."""
from __future__ import annotations

import json
import math
import os

import pytest

from kvkeeper.server import bench
from kvkeeper.server.bench import checksum_bench, control_bench, data_bench, gc_bench, ledger_bench
from kvkeeper.server.bench.result import Result, parse_target, percentile, render_table
from kvkeeper.server.ledger.policy import POLICIES
from kvkeeper.server.cli import main as cli_main

KEYS = {"name", "group", "value", "unit", "baseline_name", "baseline_value", "ratio", "better",
        "target", "target_of", "meets_target", "params", "note"}


def check_shape(items: list, group: str, expect_names: set[str]) -> None:
    assert isinstance(items, list) and items
    names = [r["name"] for r in items]
    assert len(names) == len(set(names)), "result names are unique"
    assert expect_names <= set(names), expect_names - set(names)
    for r in items:
        assert set(r) == KEYS, r
        assert r["group"] == group and r["name"].startswith(group + ".")
        assert isinstance(r["value"], float) and math.isfinite(r["value"]) and r["value"] > 0, r
        assert isinstance(r["baseline_value"], float) and r["baseline_value"] > 0, r
        assert r["baseline_name"] and r["unit"]
        assert r["ratio"] == pytest.approx(r["value"] / r["baseline_value"])
        assert r["better"] in ("lower", "higher")
        assert r["target_of"] in ("ratio", "value")
        assert isinstance(r["params"], dict)
        if r["target"] is None:
            assert r["meets_target"] is None
        else:
            op, bound = parse_target(r["target"])
            assert isinstance(r["meets_target"], bool)
            subject = r["ratio"] if r["target_of"] == "ratio" else r["value"]
            assert r["meets_target"] == {"<=": subject <= bound, ">=": subject >= bound,
                                         "<": subject < bound, ">": subject > bound}[op]


def run_cli(capsys: pytest.CaptureFixture[str], *argv: str) -> list:
    rc = cli_main(["bench", *argv, "--quick", "--json", "-q"])
    out = capsys.readouterr().out
    assert rc == 0, out
    return json.loads(out)


def test_ledger_quick(capsys: pytest.CaptureFixture[str]) -> None:
    items = run_cli(capsys, "ledger")
    by = {r["name"]: r for r in items}
    for p in POLICIES:   # every figure for every policy
        check_shape([r for r in items if r["params"]["policy"] == p], "ledger", {
            f"ledger.match_ns_per_block.10k.{p}", f"ledger.match_ns_per_block.100k.{p}",
            f"ledger.evict_ns_per_block.10k.{p}", f"ledger.evict_ns_per_block.100k.{p}",
            f"ledger.evict_cold_ns_per_block.10k.{p}", f"ledger.evict_cold_ns_per_block.100k.{p}",
            f"ledger.evict_flatness.100k_vs_10k.{p}", f"ledger.evict_cold_flatness.100k_vs_10k.{p}",
            f"ledger.memory_bytes_per_block.100k.{p}"})
        mem = by[f"ledger.memory_bytes_per_block.100k.{p}"]
        assert mem["target_of"] == "value" and mem["unit"] == "B/block"
        # The flatness results are the largest size's evict figure against the smallest's,
        # with the caches warm and cold.
        for cold in ("", "_cold"):
            flat = by[f"ledger.evict{cold}_flatness.100k_vs_10k.{p}"]
            assert flat["target"] is not None
            assert flat["value"] == by[f"ledger.evict{cold}_ns_per_block.100k.{p}"]["value"]
            assert "10k" in flat["baseline_name"]


def test_control_quick(capsys: pytest.CaptureFixture[str]) -> None:
    items = run_cli(capsys, "control")
    names = {f"control.match.{m}.c{c}" for m in ("p50_us", "p99_us", "ops_per_s") for c in (1, 16)}
    names |= {f"control.{k}.p50_us.c{c}" for k in ("match_grpc", "match_stub") for c in (1, 16)}
    check_shape(items, "control", names)
    by = {r["name"]: r for r in items}
    assert by["control.match.p50_us.c1"]["target"] == "<= 1.3"
    assert by["control.match.ops_per_s.c16"]["better"] == "higher"


def test_data_quick(capsys: pytest.CaptureFixture[str], tmp_path: "os.PathLike[str]") -> None:
    out = os.path.join(str(tmp_path), "data.json")
    rc = cli_main(["bench", "data", "--quick", "-q", "--out", out])
    table = capsys.readouterr().out
    assert rc == 0
    assert "data.shm.save_gbps.256KiB" in table and "targets met" in table
    with open(out) as fh:
        items = json.load(fh)
    names = {f"data.{k}.{d}_gbps.{s}" for k in ("shm", "stream", "shm_xxh3", "shm_crc32")
             for d in ("save", "load") for s in ("256KiB", "1MiB", "4MiB")}
    check_shape(items, "data", names)
    by = {r["name"]: r for r in items}
    assert by["data.shm.load_gbps.1MiB"]["target"] is None   # the default checksum's row has it
    assert by["data.stream.save_gbps.4MiB"]["target"] == ">= 0.9"
    assert by["data.stream.load_gbps.1MiB"]["params"]["checksum"] == "xxh3"
    assert by["data.shm_crc32.load_gbps.4MiB"]["target"] is None
    assert by["data.shm_xxh3.load_gbps.4MiB"]["params"]["checksum"] == "xxh3"
    assert {by[f"data.shm_xxh3.{d}_gbps.{s}"]["target"] for d in ("save", "load")
            for s in ("256KiB", "1MiB", "4MiB")} == {">= 0.7"}


def test_checksum_quick(capsys: pytest.CaptureFixture[str]) -> None:
    items = run_cli(capsys, "checksum")
    kinds = ["zlib_crc32", "xxh3_64", "xxh3_64_pieces", *checksum_bench.COPY_KINDS]
    names = {f"checksum.{k}.gbps.{s}" for k in kinds for s in ("256KiB", "1MiB", "4MiB")}
    check_shape(items, "checksum", names)
    by = {r["name"]: r for r in items}
    assert by["checksum.xxh3_64.gbps.1MiB"]["target"] == ">= 10"
    assert by["checksum.xxh3_64.gbps.1MiB"]["target_of"] == "value"
    assert by["checksum.xxh3_64_pieces.gbps.4MiB"]["params"]["pieces"] == checksum_bench.PIECES
    assert by["checksum.copy_then_xxh3_dst.gbps.256KiB"]["target"] is None
    assert "checksum" in bench.BENCHES


def test_disk_quick(capsys: pytest.CaptureFixture[str]) -> None:
    items = run_cli(capsys, "disk")
    names = {f"disk.{d}_gbps.{s}" for d in ("save", "load") for s in ("256KiB", "1MiB", "4MiB")}
    check_shape(items, "disk", names | {"disk.restart_seconds.2k", "disk.restart_seconds.10k"})
    by = {r["name"]: r for r in items}
    assert by["disk.save_gbps.1MiB"]["target"] == ">= 0.7"
    assert by["disk.restart_seconds.10k"]["params"]["blocks"] == 10_000


def test_gc_tiny_runs_both_configurations_on_one_schedule() -> None:
    """`bench gc` at a tiny size (the CLI's --quick is 100k blocks): shape, both
    configurations measured, the policy's collections only in its ticks, and
    the GC state of the process left as it was found."""
    import gc
    thresholds, frozen, callbacks = gc.get_threshold(), gc.get_freeze_count(), len(gc.callbacks)
    # A tick before every request (the real interval is 1 s of the request schedule).
    scale = gc_bench.Scale(blocks=4 * (gc_bench.CHAIN + gc_bench.SAVE), requests=40, rounds=2,
                           calibrate=5, interval_s=1e-9)
    results = gc_bench.run(scale=scale)
    assert gc.get_threshold() == thresholds and gc.get_freeze_count() == frozen
    assert gc.isenabled() and len(gc.callbacks) == callbacks
    items = [r.as_dict() for r in results]
    label = "5120"
    latency = {f"gc.match_{q}_us.{label}" for q in ("p50", "p99", "max")}
    check_shape([r for r in items if r["name"] in latency], "gc", latency)
    by = {r["name"]: r for r in items}
    assert set(by) == latency | {f"gc.longest_pause_ms.{label}"}
    assert by[f"gc.match_p50_us.{label}"]["value"] <= by[f"gc.match_p99_us.{label}"]["value"] \
        <= by[f"gc.match_max_us.{label}"]["value"]
    p = by[f"gc.match_p99_us.{label}"]["params"]
    assert p["resident_blocks"] == 5120 and p["requests_per_config"] == 80 and len(p["gap_ms"]) == 2
    assert p["policy"]["full_collections_in_requests"] == 0
    # Each policy phase starts settled at t=0, so its first request has no tick before it.
    assert p["policy"]["ticks"] == 2 * 39 and p["default"]["ticks"] == 0
    pause = by[f"gc.longest_pause_ms.{label}"]
    assert pause["value"] > 0 and pause["unit"] == "ms"


def test_gc_is_in_all() -> None:
    assert "gc" in bench.BENCHES
    with pytest.raises(ValueError, match="at least"):
        gc_bench.run(scale=gc_bench.Scale(blocks=100, requests=1, rounds=1))


def test_usage_errors() -> None:
    assert bench.main(["nope"]) == 2
    assert bench.main([]) == 2
    assert bench.main(["--help"]) == 0
    assert bench.main(["data", "--model", "m.json"]) == 2, "--model is for ttft only"
    assert bench.main(["data", "--trace", "t.jsonl"]) == 2, "--trace is for policy only"
    assert bench.main(["data", "--seed", "3"]) == 2, "--seed is for policy only"
    assert bench.main(["policy", "--mix", "turn_gap"]) == 2, "FIELD=VALUE"
    assert bench.main(["policy", "--quick", "-q", "--mix", "nope=1"]) == 2, "no such field"


def test_result_math_and_table() -> None:
    r = Result(name="x.lat", value=3.0, unit="us", baseline_name="b", baseline_value=2.0,
               better="lower", target="<= 1.5")
    assert r.ratio == 1.5 and r.meets_target is True and r.group == "x"
    r = Result(name="x.rate", value=1.0, unit="GB/s", baseline_name="b", baseline_value=2.0,
               better="higher", target=">= 0.6")
    assert r.ratio == 0.5 and r.meets_target is False
    r = Result(name="x.mem", value=250.0, unit="B", baseline_name="b", baseline_value=100.0,
               better="lower", target="<= 300", target_of="value")
    assert r.meets_target is True
    info = Result(name="x.i", value=1.0, unit="u", baseline_name="b", baseline_value=1.0,
                  better="lower")
    assert info.target is None and info.meets_target is None
    text = render_table([r, info])
    assert "x.mem" in text and "1/1 targets met" in text
    with pytest.raises(ValueError):
        parse_target("about 2")
    with pytest.raises(ValueError):
        Result(name="x", value=1, unit="u", baseline_name="b", baseline_value=1, better="up")
    assert percentile([1, 2, 3, 4], 50) == 2.5
    assert percentile([5], 99) == 5


def test_scales_are_consistent() -> None:
    for quick in (True, False):
        ls = ledger_bench.Scale.for_mode(quick)
        assert ls.memory_blocks in ls.sizes
        cs = control_bench.Scale.for_mode(quick)
        assert set(cs.calls) == set(cs.concurrency)
        gs = gc_bench.Scale.for_mode(quick)
        assert gs.blocks >= 4 * (gc_bench.CHAIN + gc_bench.SAVE) and gs.rounds >= 1
        ds = data_bench.Scale.for_mode(quick)
        assert all(ds.move_bytes % b == 0 and b % data_bench.PAGE_BYTES == 0
                   for b in ds.block_sizes)


def test_policy_quick(capsys: pytest.CaptureFixture[str]) -> None:
    """`bench policy --quick`: every policy on every mix at every capacity point,
    against the optimum; the default policy carries the targets."""
    from kvkeeper.server.bench import policy_bench
    from kvkeeper.server.bench.policy_trace import MIXES
    from kvkeeper.server.ledger.policy import DEFAULT_POLICY
    items = run_cli(capsys, "policy")
    labels = [f"{m}.{round(p * 100)}pct" for m in MIXES for p in policy_bench.POINTS]
    expect = {f"policy.hit_ratio.{lb}.{p}" for lb in labels for p in POLICIES}
    expect |= {f"policy.default_vs_lru.{lb}" for lb in labels}
    expect |= {f"policy.told.{lb}.{DEFAULT_POLICY}" for lb in labels}
    expect |= {f"policy.hinted.{lb}.{p}" for lb in labels for p in POLICIES}
    expect |= {f"policy.blind.{lb}" for lb in labels}
    check_shape(items, "policy", expect)
    by = {r["name"]: r for r in items}
    for lb in labels:
        for p in POLICIES:
            r = by[f"policy.hit_ratio.{lb}.{p}"]
            assert 0 < r["value"] <= r["baseline_value"] + 1e-9 <= 1 + 1e-9   # never above optimum
            assert (r["target"] is not None) == (p == DEFAULT_POLICY)
            assert r["params"]["stranded_blocks_left"] == 0
            assert 0 <= r["params"]["dead_share_of_cache"] <= 1
        # The told replay is analysis (no target), never above the optimum, and
        # holds no block that nobody reads again.
        for p in POLICIES:   # with the trace's last-turn hints: the same contract
            r = by[f"policy.hinted.{lb}.{p}"]
            assert 0 < r["value"] <= r["baseline_value"] + 1e-9
            assert (r["target"] is not None) == (p == DEFAULT_POLICY)
            assert r["params"]["stranded_blocks_left"] == 0 and r["params"]["last_turns"] > 0
        told = by[f"policy.told.{lb}.{DEFAULT_POLICY}"]
        assert told["target"] is None and told["value"] <= told["baseline_value"] + 1e-9
        assert told["params"]["dead_share_of_cache"] == 0
        # So is the optimum blind to ends; the quick traces hold ends and think times.
        blind = by[f"policy.blind.{lb}"]
        assert blind["target"] is None and 0 < blind["value"] <= blind["baseline_value"] + 1e-9
        assert blind["params"]["last_turns"] > 0 and blind["params"]["think_times"] > 0


def test_policy_replays_a_recorded_trace(capsys: pytest.CaptureFixture[str],
                                         tmp_path: "os.PathLike[str]") -> None:
    from kvkeeper.server.bench.policy_trace import MIXES, generate, write_trace
    path = os.path.join(str(tmp_path), "trace.jsonl")
    write_trace(generate(MIXES["chat-heavy"].scaled(150), seed=5), path)
    items = run_cli(capsys, "policy", "--trace", path)
    assert {r["params"]["mix"] for r in items} == {"trace"}
    assert {r["params"]["requests"] for r in items} == {150}
    bad = os.path.join(str(tmp_path), "bad.jsonl")
    with open(bad, "w") as fh:
        fh.write("nope\n")
    assert bench.main(["policy", "--trace", bad, "-q"]) == 2


def test_policy_runs_another_seed_and_a_changed_mix() -> None:
    from kvkeeper.server.bench import policy_bench
    items = policy_bench.run(requests=80, seed=3, policies=["lru"],
                             mix_changes={"turn_gap": "80", "scan_blocks": "32:64"})
    assert {(r.params["seed"], tuple(r.params["mix_changes"].items())) for r in items} == {
        (3, (("turn_gap", "80"), ("scan_blocks", "32:64")))}
    with pytest.raises(ValueError, match="LOW:HIGH"):
        policy_bench.run(requests=80, policies=["lru"], mix_changes={"scan_blocks": "32"})
