"""The two vLLM base modules the connector's load and save code imports
(connector/stats.py, connector/metadata.py), as stand-ins for a GPU machine
without vLLM: so tests/gpu/test_cuda_connector.py runs the connector's CUDA
hooks there instead of skipping. Only installed when vLLM does not import;
the stand-ins have the surface those modules use, nothing of vLLM's logic."""
from __future__ import annotations

import importlib.util
import sys
import types
from dataclasses import dataclass, field
from typing import Any

BASE = "vllm.distributed.kv_transfer.kv_connector.v1.base"
METRICS = "vllm.distributed.kv_transfer.kv_connector.v1.metrics"


@dataclass
class KVConnectorStats:
    data: dict[str, Any] = field(default_factory=dict)


class KVConnectorPromMetrics:
    def __init__(self, *args: Any, **kwargs: Any) -> None:
        pass


class KVConnectorMetadata:
    pass


class KVConnectorWorkerMetadata:
    pass


def install_if_missing() -> bool:
    """Put the stand-ins in sys.modules unless vLLM imports; True if it did not."""
    try:
        if importlib.util.find_spec("vllm") is not None:
            return False
    except (ImportError, ValueError):
        pass
    parts = BASE.split(".")
    for i in range(1, len(parts)):
        name = ".".join(parts[:i])
        mod = sys.modules.setdefault(name, types.ModuleType(name))
        mod.__path__ = []          # a package, so its submodules resolve from sys.modules
    base, metrics = types.ModuleType(BASE), types.ModuleType(METRICS)
    base.KVConnectorMetadata, base.KVConnectorWorkerMetadata = (KVConnectorMetadata,
                                                                KVConnectorWorkerMetadata)
    metrics.KVConnectorStats, metrics.KVConnectorPromMetrics = (KVConnectorStats,
                                                                KVConnectorPromMetrics)
    sys.modules[BASE], sys.modules[METRICS] = base, metrics
    return True
