"""What the daemon-level cluster tests share: a namespace, keys and blocks,
a daemon config with the cluster tier, a client, and a start-up that must fail."""
from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from kvkeeper.client import AsyncClient
from kvkeeper.server.app import create_server
from kvkeeper.server.config import ConfigError

BLOCK = 4 * 4096


def ns() -> dict:
    return dict(model_id="tiny", dtype="float16", kv_layout="NHD", block_tokens=32,
                block_bytes=BLOCK)


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [(salt * 100000 + i).to_bytes(4, "little") * 8 for i in range(n)]


def blocks(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(n)]


def cluster_cfg(url: str, prefix: str, **kw: Any) -> dict:
    base = {"cluster_tier.url": url, "cluster_tier.key_prefix": prefix,
            "cluster_tier.timeout_seconds": 5.0}   # generous: CI hosts are busy
    base.update({f"cluster_tier.{k}": v for k, v in kw.items()})
    return base


async def connect(d: Any) -> AsyncClient:
    return await AsyncClient.connect(f"unix://{d.socket_path}", ns())


def ns_id(d: Any) -> bytes:
    (namespace,) = d.ledger.namespaces.values()
    return namespace.id


def start_fails(daemon_config: Any, **overrides: Any) -> ConfigError:
    with pytest.raises(ConfigError) as e:
        d, _ = create_server(daemon_config(**overrides))
        d.arena.close()
    return e.value


def load_pki() -> Any:
    """tests/e2e/pki.py (a throwaway CA and certificates), as a module."""
    if "pki" in sys.modules:
        return sys.modules["pki"]
    spec = importlib.util.spec_from_file_location(
        "pki", Path(__file__).resolve().parents[3] / "e2e" / "pki.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod
