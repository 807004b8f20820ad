"""Building a connector's scheduler or worker side from vLLM's config: the
model identity, each TP rank's namespace and its daemon session."""
from __future__ import annotations

import logging
import os
import socket
from typing import TYPE_CHECKING, Any, Dict, Optional, Sequence, Union

from .config import ConnectorConfig
from .layout import KVLayout, namespace_descriptor
from .link import DaemonLink
from .model_identity import model_identity
from .scheduler import SchedulerSide

if TYPE_CHECKING:
    from .groups import GroupedWorker
    from .worker import WorkerSide

__all__ = ["SideBuilder"]

log = logging.getLogger("kvkeeper.connector")


class SideBuilder:
    """Builds the sides of one connector; vllm_config is vLLM's VllmConfig."""

    def __init__(self, vllm_config: Any, kv_transfer_config: Any) -> None:
        self._vllm_config = vllm_config
        self._ktc = kv_transfer_config

    def scheduler(self, cfg: ConnectorConfig,
                  layouts: Union[KVLayout, Sequence[KVLayout]],
                  peer: Optional[Any] = None) -> SchedulerSide:
        """Sessions and namespaces per TP rank, and per KV cache group where
        there are several (slot rank * groups + group: connector/groups.py)."""
        lays = [layouts] if isinstance(layouts, KVLayout) else list(layouts)
        size, g = self._tp_size(), len(lays)
        mid = self._model_id(cfg)
        slots = [(r, i) for r in range(size) for i in range(g)]
        nss = [self._namespace(cfg, lays[i], mid, r, size) for r, i in slots]
        links = [self._link(cfg, ns, cfg.lookup_timeout_s, f"scheduler tp{r}{_group(i, g)}")
                 for (r, i), ns in zip(slots, nss)]
        log.info("kvkeeper: scheduler side for %s, namespace %s%s", cfg.url, nss[0],
                 f" (and {len(nss) - 1} more)" if len(nss) > 1 else "")
        return SchedulerSide(cfg, lays[0], nss, links, groups=g,
                             async_loads=_grouped(layouts),
                             peer=peer.match if peer and g == 1 else None)

    def scheduler_peer(self, cfg: ConnectorConfig, num_blocks: int) -> Optional[Any]:
        """The scheduler's peer side (peer/sched.py) where kvkeeper_peer is on
        and can be (TP 1, the daemon on a unix socket), else None."""
        if not cfg.peer or self._tp_size() != 1:
            return None
        from .peer.sched import SchedulerPeer, peer_socket_for   # no torch

        sock = peer_socket_for(cfg.url)
        if sock is None or num_blocks <= 0:
            return None
        return SchedulerPeer(sock, self.engine_id, num_blocks, cfg.lookup_timeout_s)

    @property
    def engine_id(self) -> str:
        return str(getattr(self._ktc, "engine_id", "") or "")

    def worker(self, cfg: ConnectorConfig, layouts: Union[KVLayout, Sequence[KVLayout]]
               ) -> "Union[WorkerSide, GroupedWorker]":
        from .groups import GroupedWorker, slot_of  # torch, only in workers
        from .worker import WorkerSide

        lays = [layouts] if isinstance(layouts, KVLayout) else list(layouts)
        size, g = self._tp_size(), len(lays)
        rank = 0
        if size > 1:
            from vllm.distributed.parallel_state import get_tensor_model_parallel_rank
            rank = get_tensor_model_parallel_rank()
        mid = self._model_id(cfg)
        sides = []
        for i, lay in enumerate(lays):
            ns = self._namespace(cfg, lay, mid, rank, size)
            link = self._link(cfg, ns, cfg.io_timeout_s, f"worker tp{rank}{_group(i, g)}")
            # Same-host peer handles (peer/) serve one KV cache group only.
            sides.append(WorkerSide(cfg, lay, slot_of(rank, i, g), link,
                                    engine=self.engine_id if g == 1 else ""))
        return GroupedWorker(sides) if _grouped(layouts) else sides[0]

    @staticmethod
    def disabled_worker(reason: str, grouped: bool = False
                        ) -> "Union[WorkerSide, GroupedWorker]":
        """A worker side that only answers for the loads the scheduler may
        still plan (its side may be fine): every block failed, recompute it
        (grouped: as the failed asynchronous loads of groups.py)."""
        from .groups import GroupedWorker  # torch, only in workers
        from .worker import WorkerSide

        w = WorkerSide(None, None, 0, None)
        w.disable(reason)
        return GroupedWorker([w]) if grouped else w

    def _instance_id(self, what: str) -> str:
        engine = getattr(self._ktc, "engine_id", "") or ""
        return f"vllm {socket.gethostname()} pid {os.getpid()} engine {engine} {what}"[:256]

    def _link(self, cfg: ConnectorConfig, ns: Dict[str, Any], timeout: float,
              what: str) -> DaemonLink:
        return DaemonLink(cfg.url, ns, instance_id=self._instance_id(what), timeout=timeout,
                          max_retries=cfg.max_retries, transport=cfg.transport,
                          checksum=cfg.checksum, reconnect_min_s=cfg.reconnect_min_s,
                          reconnect_max_s=cfg.reconnect_max_s, name=f"kvkeeper[{what}]",
                          token=cfg.token, tls=cfg.client_tls())

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


def _grouped(layouts: Union[KVLayout, Sequence[KVLayout]]) -> bool:
    """Whether vLLM's hybrid allocator manages these layouts (hma.py gives a
    sequence) with several groups or a sliding window: then vLLM frees
    blocks behind the window (null blocks in the block table) and takes no
    per-block load failures, and groups.py serves them. A single layout
    (KVKeeperConnector, the allocator off) keeps every block: a window
    there is only in the namespace."""
    if isinstance(layouts, KVLayout):
        return False
    return len(layouts) > 1 or any(lay.sliding for lay in layouts)


def _group(index: int, groups: int) -> str:
    return f" group {index}" if groups > 1 else ""
