"""The cluster tier's series in a daemon's /metrics (kvkeeper_cluster_*): present
at start-up with or without a reachable cluster, typed as declared, following
the tier's traffic, faults by kind with the fixed label set, and clean for
`promtool check metrics`. Against a real redis-server (tests/redis_servers.py)."""
from __future__ import annotations

import os
import shutil
import subprocess
import uuid

import pytest
from prometheus_client.parser import text_string_to_metric_families

from kvkeeper.client import AsyncClient
from redis_servers import free_port, needs_redis, redis_server  # noqa: F401 - a fixture

BLOCK = 4 * 4096
COUNTERS = ("hit_blocks", "miss_blocks", "read_bytes", "written_bytes", "written_blocks",
            "dropped_writes", "corrupt_values", "vanished_blocks", "probes", "probed_keys",
            "timeouts", "skipped_calls", "reconnects")
GAUGES = ("up", "used_memory_bytes", "maxmemory_bytes")

pytestmark = needs_redis


def ns() -> dict:
    return dict(model_id="tiny", dtype="float16", kv_layout="NHD", block_tokens=32,
                block_bytes=BLOCK)


def cfg(url: str) -> dict:
    return {"cluster_tier.url": url, "cluster_tier.key_prefix": f"m{uuid.uuid4().hex[:8]}:",
            "cluster_tier.timeout_seconds": 2.0}


def families(daemon) -> dict:
    return {f.name: f for f in text_string_to_metric_families(daemon.metrics.render().decode())}


def value(fams: dict, name: str, **labels: str) -> float:
    [s] = [s for s in fams[name].samples if s.labels == labels and not s.name.endswith("_created")]
    return s.value


def test_the_fault_kinds_are_the_tiers():
    from kvkeeper.server.tiers.cluster.client import FAULT_KINDS
    assert "timeout" in FAULT_KINDS and "connection" in FAULT_KINDS and len(FAULT_KINDS) <= 12


async def test_series_exist_at_start_up_and_follow_the_traffic(daemon_factory, redis_server):
    from kvkeeper.server.tiers.cluster.client import FAULT_KINDS

    d = await daemon_factory(**cfg(f"redis://{redis_server.address}"))
    fams = families(d)
    for name in COUNTERS:
        assert fams[f"kvkeeper_cluster_{name}"].type == "counter", name
        assert value(fams, f"kvkeeper_cluster_{name}") == 0, name
    for name in GAUGES:
        assert fams[f"kvkeeper_cluster_{name}"].type == "gauge", name
    assert value(fams, "kvkeeper_cluster_up") == 1
    errs = fams["kvkeeper_cluster_errors"]
    assert errs.type == "counter"
    assert {s.labels["kind"] for s in errs.samples} == set(FAULT_KINDS)
    assert all(s.value == 0 for s in errs.samples)

    c = await AsyncClient.connect(f"unix://{d.socket_path}", ns())
    keys = [bytes([i]) * 32 for i in range(3)]
    assert (await c.save(keys, [bytes([i]) * BLOCK for i in range(3)])).committed == 3
    await d.cluster.refresh_memory()   # what the reaper's poll does every 10 s
    fams = families(d)
    assert value(fams, "kvkeeper_cluster_written_blocks") == 3
    assert value(fams, "kvkeeper_cluster_written_bytes") > 3 * BLOCK   # headers included
    assert value(fams, "kvkeeper_cluster_used_memory_bytes") > 3 * BLOCK
    await c.close()


async def test_an_unreachable_cluster_is_up_0_and_counts_faults(daemon_factory):
    d = await daemon_factory(**cfg(f"redis://127.0.0.1:{free_port()}"))
    assert value(families(d), "kvkeeper_cluster_up") == 0
    c = await AsyncClient.connect(f"unix://{d.socket_path}", ns())
    assert (await c.match([b"\x01" * 32])).matched == 0      # a miss, not an error
    fams = families(d)
    # Sent and failed, or not sent at all while the cluster is known to be down.
    assert value(fams, "kvkeeper_cluster_errors", kind="connection") + \
        value(fams, "kvkeeper_cluster_skipped_calls") >= 1
    assert value(fams, "kvkeeper_cluster_up") == 0
    await c.close()


async def test_promtool_check_metrics_with_a_cluster_tier(daemon_factory, redis_server):
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing: .ci/run must install prometheus")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    d = await daemon_factory(**cfg(f"redis://{redis_server.address}"))
    text = d.metrics.render()
    assert b"kvkeeper_cluster_errors_total{kind=\"timeout\"}" in text
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    assert not proc.stdout.strip() and not proc.stderr.strip(), (proc.stdout + proc.stderr).decode()
