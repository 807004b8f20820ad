"""`kvkeeper bench cluster` at tiny sizes: it starts its own redis-server (and
Redis Cluster), runs the tier and the raw client side by side and emits its
rows in the usual result format. No figure is asserted, only that every row
is there, well formed and measured (finite, positive, with its baseline)."""
from __future__ import annotations

import json
import math
import shutil

import pytest

from kvkeeper.server.bench import build_parser, cluster_bench, main
from kvkeeper.server.bench.registry import BenchUnavailable, NAMED_BENCHES, runner
from kvkeeper.server.bench.result import to_json

needs_redis = pytest.mark.skipif(
    not (shutil.which("redis-server") or shutil.which("valkey-server"))
    or not (shutil.which("redis-cli") or shutil.which("valkey-cli")),
    reason="redis-server/redis-cli not installed (tests/run.sh installs Debian's redis-server)")


def check_rows(results, suffix: str) -> None:
    names = [r.name for r in results]
    assert names == [f"cluster.save_gbps.64KiB{suffix}", f"cluster.load_gbps.64KiB{suffix}",
                     f"cluster.probe_p50_us.256{suffix}"]
    for r in results:
        assert r.group == "cluster"
        assert math.isfinite(r.value) and r.value > 0, r
        assert math.isfinite(r.baseline_value) and r.baseline_value > 0, r
        assert r.ratio == pytest.approx(r.value / r.baseline_value)
        assert r.params["server"] == ("single" if not suffix else "cluster")
    save, load, probe = results
    assert (save.unit, load.unit, probe.unit) == ("GB/s", "GB/s", "us")
    assert save.target == load.target == ">= 0.8" and save.better == load.better == "higher"
    assert "SET" in save.baseline_name and "GET" in load.baseline_name
    assert probe.target is None and probe.better == "lower" and "EXISTS" in probe.baseline_name
    assert probe.params["keys"] == 256


@needs_redis
def test_tiny_run_against_one_server_emits_every_row() -> None:
    lines: list[str] = []
    results = cluster_bench.run(tiny=True, redis_cluster=False, log=lines.append)
    check_rows(results, "")
    # The usual JSON shape, and a progress line per measurement.
    rows = json.loads(to_json(results))
    assert {"name", "value", "baseline_value", "ratio", "meets_target"} <= set(rows[0])
    assert any("probe of 256 keys" in line for line in lines)


@needs_redis
def test_tiny_run_against_a_redis_cluster_adds_its_rows() -> None:
    results = cluster_bench.run(tiny=True, redis_cluster=True)
    check_rows(results[:3], "")
    check_rows(results[3:], ".cluster")


def test_it_is_run_by_name_only() -> None:
    assert "cluster" in NAMED_BENCHES and runner("cluster") is cluster_bench.run
    assert build_parser().parse_args(["cluster", "--redis-cluster"]).redis_cluster is True
    assert build_parser().parse_args(["cluster"]).redis_cluster is None
    assert main(["ledger", "--redis-cluster", "-q"]) == 2   # the flag is cluster's only


def test_without_redis_server_it_says_what_to_install(monkeypatch, tmp_path, capsys) -> None:
    monkeypatch.setenv("PATH", str(tmp_path))
    with pytest.raises(BenchUnavailable, match="redis-server"):
        cluster_bench.run(tiny=True)
    assert main(["cluster", "--quick", "-q"]) == 1
    assert "apt-get install redis-server" in capsys.readouterr().err
