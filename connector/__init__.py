"""kvkeeper.connector: the vLLM KV connector backed by a kvkeeper daemon.

Enable it with

    --kv-transfer-config '{"kv_connector": "KVKeeperConnector",
                           "kv_connector_module_path": "kvkeeper.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvkeeper_url": "unix:///path/kvkeeper.sock"}}'

(or the same dict as LLM(kv_transfer_config=...)); config.py lists the
settings. Modules, one concept each:

  keys       chained sha256 block keys (pure Python)
  layout     the KV layout of a TP rank and its namespace descriptor (pure Python)
  model_identity  the namespace's model id, from the model's files (pure Python)
  config     the kv_connector_extra_config settings (kvkeeper.client.url)
  blocks     block bytes <-> vLLM's paged KV tensors (torch)
  link       a daemon session, probed back by a watcher after a failure (kvkeeper.client)
  releaser   lease releases on a background thread (kvkeeper.client)
  metadata   what the scheduler side tells the workers each step, and back (vLLM)
  stats      counters -> vLLM's KVConnectorStats and Prometheus metrics (vLLM)
  cpus       the CPUs the connector's own threads run on
  sched_state  the scheduler side's per-request state
  lookup     a lookup in flight on every TP rank and the lease its answer holds
  save_plan  the step's SaveSpecs
  scheduler  lookups, load and save plans, releases, as vLLM's hooks call them (scheduler role)
  io_thread  the worker's I/O thread, on the cores vLLM leaves spare (cpus)
  load/      loads into the KV cache: fetching, the load strategies, streaming (torch)
  save       the save thread: blocks copied out of the KV cache and sent (torch)
  gpu/       a KV cache on CUDA: pinned arena, side-stream copies ordered by events (torch)
  worker     a TP rank's loads and saves, as vLLM's hooks call them (worker role; torch)
  guard      every vLLM hook guarded: an exception is logged and answered by a fallback
  sides      a connector's scheduler or worker side built from vLLM's config
  vllm_logging  kvkeeper's logs through vLLM's handler
  connector  the KVConnectorBase_V1 subclass, dispatching by role (vLLM)
  groups     several KV cache groups: a worker side per group, sliding windows (torch)
  hma        KVKeeperHMAConnector: the connector with vLLM's hybrid allocator (vLLM)

`KVKeeperConnector` (and `KVKeeperHMAConnector`, for vLLM's hybrid
allocator: several KV cache groups, see hma.py) is imported on first access, so `kvkeeper.connector.keys`
and friends can be used (and kvkeeper.client / kvkeeper.server are never
affected) where vLLM and torch are not installed.
"""
from __future__ import annotations

from typing import Any

__all__ = ["KVKeeperConnector", "KVKeeperHMAConnector"]


def __getattr__(name: str) -> Any:
    if name == "KVKeeperConnector":
        from .connector import KVKeeperConnector

        return KVKeeperConnector
    if name == "KVKeeperHMAConnector":
        from .hma import KVKeeperHMAConnector

        return KVKeeperHMAConnector
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
