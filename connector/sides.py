"""Building a connector's scheduler or worker side from vLLM's config: the
model identity, each TP rank's namespace and its daemon session."""
from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any, Dict

from .config import ConnectorConfig
from .layout import KVLayout, namespace_descriptor
from .link import DaemonLink
from .model_identity import model_identity
from .scheduler import SchedulerSide

if TYPE_CHECKING:
    from .worker import WorkerSide

__all__ = ["SideBuilder"]

log = logging.getLogger("kvkeeper.connector")


class SideBuilder:
    """Builds the sides of one connector; vllm_config is vLLM's VllmConfig."""

    def __init__(self, vllm_config: Any, kv_transfer_config: Any) -> None:
        self._vllm_config = vllm_config
        self._ktc = kv_transfer_config

    def scheduler(self, cfg: ConnectorConfig, layout: KVLayout) -> SchedulerSide:
        size = self._tp_size()
        mid = self._model_id(cfg)
        nss = [self._namespace(cfg, layout, mid, r, size) for r in range(size)]
        links = [self._link(cfg, ns, cfg.lookup_timeout_s, f"scheduler tp{r}")
                 for r, ns in enumerate(nss)]
        log.info("kvkeeper: scheduler side for %s, namespace %s", cfg.url, nss[0])
        return SchedulerSide(cfg, layout, nss, links)

    def worker(self, cfg: ConnectorConfig, layout: KVLayout) -> "WorkerSide":
        from .worker import WorkerSide  # torch, only in workers

        size = self._tp_size()
        rank = 0
        if size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            rank = get_tensor_model_parallel_rank()
        ns = self._namespace(cfg, layout, self._model_id(cfg), rank, size)
        link = self._link(cfg, ns, cfg.io_timeout_s, f"worker tp{rank}")
        return WorkerSide(cfg, layout, rank, link)

    @staticmethod
    def disabled_worker(reason: str) -> "WorkerSide":
        """A worker side that only answers for the loads the scheduler may
        still plan (its side may be fine): every block failed, recompute it."""
        from .worker import WorkerSide  # torch, only in workers

        w = WorkerSide(None, None, 0, None)
        w.disable(reason)
        return w

    def _instance_id(self, what: str) -> str:
        engine = getattr(self._ktc, "engine_id", "") or ""
        return f"vllm {socket.gethostname()} pid {os.getpid()} engine {engine} {what}"[:256]

    def _link(self, cfg: ConnectorConfig, ns: Dict[str, Any], timeout: float,
              what: str) -> DaemonLink:
        return DaemonLink(cfg.url, ns, instance_id=self._instance_id(what), timeout=timeout,
                          max_retries=cfg.max_retries, transport=cfg.transport,
                          checksum=cfg.checksum, reconnect_min_s=cfg.reconnect_min_s,
                          reconnect_max_s=cfg.reconnect_max_s, name=f"kvkeeper[{what}]")

    def _model_id(self, cfg: ConnectorConfig) -> str:
        model = str(getattr(self._vllm_config.model_config, "model", "") or "")
        ident = model_identity(model, cfg.model_id)
        log.info("kvkeeper: model identity %r, from %s (engines share blocks only with the "
                 "same identity; kvkeeper_model_id sets it)", ident.model_id, ident.source)
        return ident.model_id

    def _namespace(self, cfg: ConnectorConfig, layout: KVLayout, model_id: str, rank: int,
                   size: int) -> Dict[str, Any]:
        return namespace_descriptor(self._vllm_config, layout, tp_rank=rank, tp_size=size,
                                    model_id=model_id, model_revision=cfg.model_revision)

    def _tp_size(self) -> int:
        return int(getattr(self._vllm_config.parallel_config, "tensor_parallel_size", 1) or 1)
