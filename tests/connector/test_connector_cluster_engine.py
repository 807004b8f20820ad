"""Two hosts, one cluster: a vLLM engine's prefix computed on one daemon is a
full hit on another daemon, through the cluster tier (issue 16).

Two `kvkeeper serve` daemons with separate arenas (as on two hosts) share one
redis-server on loopback ([cluster_tier] url, write-through). Engine A, on
daemon 1, computes a prompt and saves its blocks; engine B, a separate process
on daemon 2, whose arena never held them, loads every full block through
daemon 2's cluster tier and must produce A's greedy tokens. One module-scoped
pair of engines (tiny seeded Llama, tests/connector/tiny_llama.py), started at
once. Run it under `flock /work/wt/engine.lock` on a shared machine.
"""
from __future__ import annotations

import os
import random
import shutil
import time
import urllib.request
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List

import pytest
from prometheus_client.parser import text_string_to_metric_families

from connector_harness import (DaemonProcess, EngineProcess, report_keys, short_tmpdir,
                               start_engines, vllm_unavailable)
from redis_servers import needs_redis, redis_server  # noqa: F401 - a fixture
from kvkeeper.server.bench.ports import free_port

pytestmark = [pytest.mark.skipif(vllm_unavailable() is not None, reason=vllm_unavailable() or ""),
              needs_redis]

BS = 32
STARTUP_S = 900.0


def scrape(address: str) -> Dict[str, float]:
    """{sample name with labels: value} of a daemon's /metrics."""
    with urllib.request.urlopen(f"http://{address}/metrics", timeout=5) as resp:
        text = resp.read().decode()
    out = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()))
            out[s.name + (f"{{{labels}}}" if labels else "")] = s.value
    return out


@dataclass
class Hosts:
    tmp: str
    d1: DaemonProcess
    d2: DaemonProcess
    a: EngineProcess
    b: EngineProcess

    def close(self) -> None:
        for e in (self.a, self.b):
            e.close()
        for d in (self.d1, self.d2):
            d.cleanup()


def daemon(tmp: str, name: str, redis_url: str) -> DaemonProcess:
    return DaemonProcess(f"{tmp}/{name}.sock", capacity="128MiB", page="32KiB",
                         log_path=f"{tmp}/daemon-{name}.log", metrics=f"127.0.0.1:{free_port()}",
                         extra_args=["--set", f"cluster_tier.url={redis_url}",
                                     "--set", "cluster_tier.write_policy=write-through",
                                     "--set", "cluster_tier.timeout_seconds=5"])


@pytest.fixture(scope="module")
def hosts(redis_server: Any) -> Iterator[Hosts]:  # noqa: F811 - the imported fixture
    from tiny_llama import write_tiny_llama

    tmp = short_tmpdir()
    model = f"{tmp}/model"
    write_tiny_llama(model)
    url = f"redis://{redis_server.address}"
    d1, d2 = daemon(tmp, "one", url), daemon(tmp, "two", url)
    d1.start()
    d2.start()
    try:
        engines = start_engines(model, (("a", d1.url), ("b", d2.url)), tmp, STARTUP_S)
    except BaseException:
        d1.cleanup()
        d2.cleanup()
        raise
    h = Hosts(tmp, d1, d2, *engines)
    try:
        yield h
    finally:
        h.close()
        if os.environ.get("KVKEEPER_TEST_KEEP_LOGS"):
            print(f"cluster engine test logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def one(engine: EngineProcess, tokens: List[int], max_tokens: int) -> Dict[str, Any]:
    r = engine.generate([tokens], max_tokens)
    return {"tokens": r["outputs"][0], "report": r["reports"][0]}


def stored_on(d: DaemonProcess, namespace: Dict[str, Any], keys: List[bytes]) -> int:
    """How many leading blocks daemon `d` finds (its arena, else the cluster), not counted as use."""
    from kvkeeper.client import Client

    c = Client.connect(d.url, namespace, instance_id="tests", timeout=5.0)
    try:
        return c.match(keys, report_use=True).matched
    finally:
        c.close()


def test_a_prefix_saved_through_one_daemon_is_a_full_hit_on_another(hosts: Hosts) -> None:
    rng = random.Random("cluster-engine")
    p = [rng.randrange(3, 500) for _ in range(5 * BS + 7)]   # 5 full blocks and 7 tokens
    a = one(hosts.a, p, 16)
    info = a["report"]["kvkeeper"]
    assert info["hit_tokens"] == 0
    keys = report_keys(a["report"], p)
    assert len(keys) == 5
    ns = info["namespace"]
    # The saves are sent in the background; write-through: committed means SET.
    deadline = time.monotonic() + 60
    while stored_on(hosts.d1, ns, keys) < len(keys):
        assert time.monotonic() < deadline, "engine A's blocks never reached daemon 1"
        time.sleep(0.1)
    before = scrape(hosts.d2.metrics)
    assert before["kvkeeper_cluster_up"] == 1
    written = scrape(hosts.d1.metrics)["kvkeeper_cluster_written_blocks_total"]
    assert written >= len(keys)
    # Daemon 2's arena never held them: what it finds, it finds in the cluster.
    assert hosts.d2.stats().tiers[0].blocks == 0
    assert stored_on(hosts.d2, ns, keys) == len(keys)

    b = one(hosts.b, p, 16)
    assert b["report"]["kvkeeper"]["hit_tokens"] == 5 * BS
    assert b["tokens"] == a["tokens"]
    after = scrape(hosts.d2.metrics)
    assert after["kvkeeper_cluster_hit_blocks_total"] - \
        before["kvkeeper_cluster_hit_blocks_total"] == len(keys)
    assert after["kvkeeper_hit_blocks_total{tier=cluster}"] >= len(keys)
    faults = {k: v for k, v in after.items() if k.startswith("kvkeeper_cluster_errors_total") and v}
    assert not faults, faults
    # Daemon 2 now holds the blocks in its own arena (promoted for B's lease).
    assert hosts.d2.stats().tiers[0].blocks >= len(keys)
