"""`kvkeeper status` with a cluster tier: the daemon's Stats carries the tiers'
own series (TierSeries), and status shows the cluster's lines (reachable,
memory, hits and misses, bytes, faults by kind), as a table and as JSON."""
from __future__ import annotations

import asyncio
import json
import uuid

import pytest

from kvkeeper.client import AsyncClient
from kvkeeper.server.cli import main
from kvkeeper.server.cli.status import cluster_summary, render_status, status_dict
from kvkeeper.v1 import kvkeeper_pb2 as pb
from redis_servers import needs_redis, redis_server  # noqa: F401 - a fixture

BLOCK = 4 * 4096
MiB = 1 << 20


def series(name: str, value: float, **labels: str) -> pb.TierSeries:
    return pb.TierSeries(name=name, kind="counter", value=value, labels=labels)


def fake_stats(with_cluster: bool) -> pb.StatsResponse:
    s = [series("disk_read_bytes", 5)]
    if with_cluster:
        s += [series("cluster_up", 0), series("cluster_hit_blocks", 12),
              series("cluster_miss_blocks", 3), series("cluster_read_bytes", 24 * MiB),
              series("cluster_written_bytes", 8 * MiB), series("cluster_written_blocks", 4),
              series("cluster_dropped_writes", 2), series("cluster_timeouts", 5),
              series("cluster_reconnects", 1), series("cluster_skipped_calls", 9), series("cluster_used_memory_bytes", 512 * MiB),
              series("cluster_maxmemory_bytes", 1024 * MiB),
              series("cluster_errors", 5, kind="timeout"),
              series("cluster_errors", 7, kind="connection"),
              series("cluster_errors", 0, kind="oom")]
    tiers = [pb.TierStats(tier=pb.TIER_HOST, capacity_bytes=64 * MiB, used_bytes=MiB)]
    if with_cluster:   # the daemon's book: only copies in flight, a placeholder capacity
        tiers.append(pb.TierStats(tier=pb.TIER_CLUSTER, capacity_bytes=1 << 50,
                                  used_bytes=2 * MiB, blocks=2))
    return pb.StatsResponse(version="x", tier_series=s, tiers=tiers)


def test_summary_and_table_from_the_series() -> None:
    c = cluster_summary(fake_stats(True).tier_series)
    assert c["up"] is False and c["hit_blocks"] == 12 and c["miss_blocks"] == 3
    assert c["errors"] == {"timeout": 5, "connection": 7, "oom": 0}
    assert "read_bytes" in c and "disk_read_bytes" not in c
    text = render_status(status_dict(fake_stats(True), "SERVING", "unix:///x"))
    lines = [line.split() for line in text.splitlines()]
    assert ["cluster", "UNREACHABLE;", "memory", "512.0", "MiB", "of", "1.0", "GiB", "maxmemory",
            "(50%)"] in lines
    assert any(line[:4] == ["hits", "12", "blocks,", "misses"] for line in lines), text
    assert ["errors:", "connection", "7,", "timeout", "5"] in lines     # zero kinds left out
    assert any(line[-7:] == ["timeouts", "5,", "skipped", "calls", "9,", "reconnects", "1"]
               for line in lines), text
    # The tier table's cluster row is the cluster's memory, not the book's placeholder.
    [row] = [line for line in lines if line[:1] == ["cluster"] and "maxmemory" not in line]
    assert row[:6] == ["cluster", "1.0", "GiB", "512.0", "MiB", "(50%)"], row
    d = status_dict(fake_stats(True), "SERVING", "unix:///x")
    [ct] = [t for t in d["tiers"] if t["tier"] == "cluster"]
    assert (ct["capacity_bytes"], ct["used_bytes"], ct["in_flight_bytes"]) == \
        (1024 * MiB, 512 * MiB, 2 * MiB)
    [ht] = [t for t in d["tiers"] if t["tier"] == "host"]
    assert ht["capacity_bytes"] == 64 * MiB and "in_flight_bytes" not in ht


def test_no_cluster_tier_no_cluster_lines() -> None:
    d = status_dict(fake_stats(False), "SERVING", "unix:///x")
    assert d["cluster"] is None
    assert "cluster" not in render_status(d)


@needs_redis
async def test_status_of_a_daemon_with_a_cluster_tier(daemon_factory, redis_server, capsys):
    from kvkeeper.server.tiers.cluster.client import FAULT_KINDS

    d = await daemon_factory(**{"cluster_tier.url": f"redis://{redis_server.address}",
                                "cluster_tier.key_prefix": f"s{uuid.uuid4().hex[:8]}:"})
    c = await AsyncClient.connect(f"unix://{d.socket_path}",
                                  dict(model_id="tiny", dtype="float16", kv_layout="NHD",
                                       block_tokens=32, block_bytes=BLOCK))
    keys = [bytes([i + 1]) * 32 for i in range(2)]
    assert (await c.save(keys, [bytes(BLOCK)] * 2)).committed == 2
    await d.cluster.refresh_memory()
    url = f"unix://{d.socket_path}"
    # status is a blocking gRPC client: off the loop that serves the daemon.
    rc = await asyncio.to_thread(main, ["status", "--url", url, "--json"])
    out = capsys.readouterr().out
    assert rc == 0, out
    got = json.loads(out)["cluster"]
    assert got["up"] is True and got["written_blocks"] == 2
    assert got["written_bytes"] > 2 * BLOCK and got["used_memory_bytes"] > 2 * BLOCK
    assert set(got["errors"]) == set(FAULT_KINDS) and not any(got["errors"].values())
    rc = await asyncio.to_thread(main, ["status", "--url", url])
    text = capsys.readouterr().out
    assert rc == 0
    assert any(line.split()[:2] == ["cluster", "up;"] for line in text.splitlines()), text
    assert "errors: none" in text
    await c.close()
