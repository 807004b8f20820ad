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
print("ok")
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]
