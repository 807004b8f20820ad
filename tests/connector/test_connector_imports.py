"""Import boundaries: the daemon and the client never pull in vLLM or torch; the
connector package exposes KVKeeperConnector lazily, the way vLLM loads it."""
from __future__ import annotations

import subprocess
import sys

import pytest

from connector_harness import vllm_unavailable

_NO_HEAVY = """
import sys
import kvkeeper.client, kvkeeper.server.app, kvkeeper.server.cli
import kvkeeper.connector, kvkeeper.connector.keys, kvkeeper.connector.layout
import kvkeeper.connector.config, kvkeeper.connector.link, kvkeeper.connector.releaser
import kvkeeper.connector.model_identity
heavy = sorted(m for m in ("torch", "vllm") if m in sys.modules)
assert not heavy, heavy
print("ok")
"""


def test_client_server_and_pure_connector_modules_do_not_import_torch_or_vllm() -> None:
    r = subprocess.run([sys.executable, "-c", _NO_HEAVY], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0 and r.stdout.strip() == "ok", r.stderr


@pytest.mark.skipif(vllm_unavailable() is not None, reason=vllm_unavailable() or "")
def test_vllm_finds_the_connector_by_module_path() -> None:
    code = """
from vllm.config.kv_transfer import KVTransferConfig
from vllm.distributed.kv_transfer.kv_connector.factory import KVConnectorFactory
from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorBase_V1
cfg = KVTransferConfig(kv_connector="KVKeeperConnector", kv_role="kv_both",
                       kv_connector_module_path="kvkeeper.connector",
                       kv_connector_extra_config={"kvkeeper_url": "unix:///nowhere.sock"})
cls = KVConnectorFactory.get_connector_class(cfg)
assert issubclass(cls, KVConnectorBase_V1), cls
stats = cls.build_kv_connector_stats({"hit_tokens": 3})
other = cls.build_kv_connector_stats({"hit_tokens": 4, "loaded_blocks": 1})
assert stats.aggregate(other).reduce() == {"hit_tokens": 7, "loaded_blocks": 1}
assert not stats.is_empty() and cls.build_kv_connector_stats().is_empty()

# the counters reach Prometheus as vllm:kvkeeper_<name>, per engine
from types import SimpleNamespace
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
prom = cls.build_prom_metrics(SimpleNamespace(kv_transfer_config=None),
                              {Counter: Counter, Gauge: Gauge, Histogram: Histogram},
                              ["model_name", "engine"], {0: ["m", "0"], 1: ["m", "1"]})
prom.observe({"hit_tokens": 5, "loaded_bytes": 4096, "unknown": 1}, engine_idx=1)
prom.observe({"hit_tokens": 2}, engine_idx=1)
get = lambda name, e: REGISTRY.get_sample_value(f"vllm:kvkeeper_{name}_total",
                                                 {"model_name": "m", "engine": e})
assert get("hit_tokens", "1") == 7 and get("loaded_bytes", "1") == 4096, get("hit_tokens", "1")
assert get("hit_tokens", "0") == 0
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
