"""Connector counters, carried to vLLM's metrics.

Each side counts into a thread-safe `Counters`; vLLM pulls a snapshot every
step through get_kv_connector_stats() as a `KVKeeperStats` (worker snapshots
travel to the scheduler in the model runner output, scheduler snapshots are
added there), and the stat loggers in the front-end process rebuild it with
build_kv_connector_stats(), log `reduce()` every interval and feed
`KVKeeperPromMetrics`, which exposes each counter as `vllm:kvkeeper_<name>`
(a Prometheus counter, per engine).
"""
from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Any, Dict, Optional

from vllm.distributed.kv_transfer.kv_connector.v1.metrics import (KVConnectorPromMetrics,
                                                                   KVConnectorStats)

__all__ = ["COUNTERS", "Counters", "KVKeeperStats", "KVKeeperPromMetrics"]

COUNTERS: Dict[str, str] = {
    # scheduler side
    "lookups": "Prefix lookups sent to the kvkeeper daemon",
    "lookup_errors": "Prefix lookups that failed (daemon down, slow or erroring) and counted as misses",
    "lookup_tokens": "Prompt tokens looked up in the daemon (beyond vLLM's own prefix cache)",
    "hit_tokens": "Prompt tokens the daemon held and vLLM scheduled to load",
    # worker side
    "loaded_blocks": "Blocks loaded from the daemon into the KV cache",
    "loaded_bytes": "Bytes loaded from the daemon into the KV cache",
    "load_errors": "Loads that failed in part or whole (those blocks were recomputed)",
    "load_error_blocks": "Blocks reported to vLLM as failed to load (recomputed)",
    "checksum_errors": "Loaded blocks whose checksum did not match (discarded, recomputed)",
    "saved_blocks": "Blocks written to the daemon",
    "saved_bytes": "Bytes written to the daemon",
    "save_present_blocks": "Blocks not written because the daemon already held them",
    "save_errors": "Save batches that failed (daemon down, full or erroring)",
    "save_dropped_blocks": "Blocks not saved: daemon unreachable, full, not admitted (a one-off "
                           "run on a full cache), or too many saves pending",
    "peer_loaded_blocks": "Blocks copied from a same-host peer engine's KV cache (kvkeeper_peer)",
    "peer_stale_blocks": "Blocks a peer reused during the copy (load errors: recomputed)",
}


@dataclass
class KVKeeperStats(KVConnectorStats):
    """Counter increments since the last snapshot: data = {name: number}."""

    def reset(self) -> None:
        self.data = {}

    def inc(self, name: str, n: float = 1) -> None:
        if n:
            self.data[name] = self.data.get(name, 0) + n

    def aggregate(self, other: KVConnectorStats) -> "KVKeeperStats":
        for k, v in (other.data or {}).items():
            if isinstance(v, (int, float)):
                self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> Dict[str, int | float]:
        return {k: v for k, v in sorted(self.data.items())}

    def is_empty(self) -> bool:
        return not any(self.data.values())


class Counters:
    """Thread-safe counters; `take()` hands the increments over and resets."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._data: Dict[str, float] = {}
        self._totals: Dict[str, float] = {}

    def inc(self, name: str, n: float = 1) -> None:
        if not n:
            return
        with self._lock:
            self._data[name] = self._data.get(name, 0) + n
            self._totals[name] = self._totals.get(name, 0) + n

    def take(self) -> Optional[KVKeeperStats]:
        with self._lock:
            if not self._data:
                return None
            data, self._data = self._data, {}
        return KVKeeperStats(data=data)

    def totals(self) -> Dict[str, float]:
        """Counts since start (not reset by take()), for logs and reports."""
        with self._lock:
            return dict(self._totals)


class KVKeeperPromMetrics(KVConnectorPromMetrics):
    """One Prometheus counter per COUNTERS entry, labelled per engine."""

    def __init__(self, vllm_config: Any, metric_types: Any, labelnames: Any,
                 per_engine_labelvalues: Any) -> None:
        super().__init__(vllm_config, metric_types, labelnames, per_engine_labelvalues)
        self._counters: Dict[str, Dict[int, Any]] = {}
        for name, doc in COUNTERS.items():
            metric = self._counter_cls(name=f"vllm:kvkeeper_{name}", documentation=doc,
                                       labelnames=labelnames)
            self._counters[name] = {idx: metric.labels(*values)
                                    for idx, values in per_engine_labelvalues.items()}

    def observe(self, transfer_stats_data: Dict[str, Any], engine_idx: int = 0) -> None:
        for name, value in (transfer_stats_data or {}).items():
            per_engine = self._counters.get(name)
            if per_engine is None or not isinstance(value, (int, float)) or value <= 0:
                continue
            child = per_engine.get(engine_idx)
            if child is not None:
                child.inc(value)
