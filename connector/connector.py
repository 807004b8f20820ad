"""KVKeeperConnector: the KVConnectorBase_V1 subclass vLLM instantiates.

vLLM creates one per role: SCHEDULER in the engine core, WORKER in every
worker process. This class only dispatches to SchedulerSide / WorkerSide
(built by sides.py) and makes sure nothing the connector does can take vLLM
down: every entry point is guarded (guard.py), an exception is logged
(rate-limited) and becomes "no hit" / "no save" / "these blocks failed to
load, recompute them". A layout the
connector cannot serve disables it, with an error in the log, instead of
failing the engine's start; so does a daemon that cannot be reached (every
lookup is a miss until it answers). An invalid kv_connector_extra_config is
the exception: it raises ConfigError from the constructor, which stops vLLM
at start-up, because a typo would otherwise turn the cache off unnoticed.
"""
from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any, Callable, Dict, List, Optional, Sequence, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorBase_V1,
                                                               KVConnectorMetadata,
                                                               KVConnectorRole,
                                                               KVConnectorWorkerMetadata)
from vllm.v1.metrics.cache_hit_source import CacheHitSource

from .config import ConfigError, ConnectorConfig
from .guard import (FailureLog, answer_all_loads_failed, answer_empty_meta, answer_miss,
                    answer_none, answer_not_delayed, guarded)
from .heap import freeze_heap
from .layout import layout_from_config
from .metadata import KVKeeperConnectorMetadata
from .residency import ResidencyReporter
from .scheduler import SchedulerSide
from .sides import SideBuilder
from .stats import KVKeeperPromMetrics, KVKeeperStats
from .vllm_logging import adopt_vllm_logging

if TYPE_CHECKING:
    import torch

    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.attention.backend import AttentionMetadata
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks, KVCacheManager
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

    from .stats import KVConnectorStats
    from .worker import WorkerSide

__all__ = ["KVKeeperConnector"]

log = logging.getLogger("kvkeeper.connector")

adopt_vllm_logging()


def _fail_loads(self: "KVKeeperConnector", *a: Any, **k: Any) -> None:
    if self._worker is not None and self.has_connector_metadata():
        self._worker.fail_loads(self._get_connector_metadata())


class KVKeeperConnector(KVConnectorBase_V1):
    """Shares prefix KV blocks between vLLM instances through a kvkeeper daemon."""

    _cache_hit_source = CacheHitSource.HOST
    # KVKeeperHMAConnector (hma.py): vLLM's hybrid allocator, asynchronous loads.
    serves_hybrid_allocator = False

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        self._sched: Optional[SchedulerSide] = None
        self._worker: "Optional[WorkerSide]" = None   # imported lazily: it needs torch
        self._peer: Any = None   # scheduler: same-host peers (peer/sched.py), kvkeeper_peer
        self._disabled: Optional[str] = None
        self.hook_failures = FailureLog()   # the guarded hooks' errors, rate-limited
        self._saving: set = set()    # scheduler: requests that planned saves
        self._delayed: set = set()   # scheduler: frees delayed, for the next step's metadata
        self._residency: Optional[ResidencyReporter] = None   # scheduler: bound with the pool
        ktc = self._kv_transfer_config
        try:
            cfg = ConnectorConfig.from_extra(ktc.kv_connector_extra_config, ktc.kv_role)
        except ConfigError as e:
            log.error("kvkeeper: %s", e)
            raise ConfigError(f"KVKeeperConnector cannot start: {e}") from None
        if role == KVConnectorRole.SCHEDULER and cfg.recompute_on_load_failure \
                and getattr(ktc, "kv_load_failure_policy", "recompute") != "recompute":
            # The scheduler reads the policy right after creating its connector.
            # A block that cannot be loaded is a cache miss: recompute it rather
            # than fail the request (opt out: kvkeeper_recompute_on_load_failure=false).
            log.info("kvkeeper: setting kv_load_failure_policy=recompute")
            ktc.kv_load_failure_policy = "recompute"
        try:
            layout = self.kv_layouts(vllm_config, kv_cache_config)
        except Exception as e:
            self._disable(str(e))
            return
        sides = SideBuilder(vllm_config, ktc)
        try:
            if role == KVConnectorRole.SCHEDULER:
                self._peer = self._scheduler_peer(sides, cfg)
                self._sched = sides.scheduler(cfg, layout, self._peer)
            else:
                self._worker = sides.worker(cfg, layout)
        except Exception as e:
            log.exception("kvkeeper: setting up the %s side failed", role.name.lower())
            self._disable(str(e))

    # ---- construction

    def _scheduler_peer(self, sides: SideBuilder, cfg: ConnectorConfig) -> Any:
        try:
            kcc = self._kv_cache_config
            return sides.scheduler_peer(cfg, int(getattr(kcc, "num_blocks", 0) or 0))
        except Exception as e:  # noqa: BLE001 - peers are an extra: run without them
            log.warning("kvkeeper: same-host peers are off for this engine: %s", e)
            return None

    @staticmethod
    def kv_layouts(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> Any:
        """The layout this connector serves: one KV cache group (this class does
        not support vLLM's hybrid allocator, so vLLM runs sliding-window
        layers as full attention in one group); KVKeeperHMAConnector serves
        several (hma.py)."""
        return layout_from_config(vllm_config, kv_cache_config)

    def _disable(self, reason: str) -> None:
        self._disabled = reason
        log.error("kvkeeper: connector disabled (%s): %s; vLLM runs without it",
                  self.role.name.lower(), reason)
        if self.role == KVConnectorRole.WORKER and self._worker is None:
            # Still answer for loads the scheduler may plan (its side may be
            # fine): report their blocks as failed, so vLLM recomputes them.
            try:
                self._worker = SideBuilder.disabled_worker(
                    reason, grouped=self.serves_hybrid_allocator)
            except Exception as e:  # noqa: BLE001
                log.error("kvkeeper: cannot even build a disabled worker side: %s", e)

    # ---- properties vLLM reads

    @property
    def requires_kv_delivery(self) -> bool:
        # A best-effort cache: a save lost to a preemption is only a future miss.
        return False

    @property
    def scheduler_side(self) -> Optional[SchedulerSide]:
        return self._sched

    @property
    def worker_side(self) -> "Optional[WorkerSide]":
        return self._worker

    # ==============================
    # Worker-side methods
    # ==============================

    @guarded(answer_none)
    def register_kv_caches(self, kv_caches: Dict[str, "torch.Tensor"]) -> None:
        if self._worker is not None:
            self._worker.register_kv_caches(kv_caches, self._kv_cache_config.num_blocks)
            # The worker's start-up is over: keep its heap out of later
            # collections, which would otherwise land inside requests' loads.
            freeze_heap()

    @guarded(_fail_loads)
    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        if not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVKeeperConnectorMetadata) or not meta.loads:
            return
        if self._worker is None:
            raise RuntimeError(f"loads were planned but this worker has no connector "
                               f"({self._disabled})")
        self._worker.start_load_kv(meta)

    @guarded(answer_none)
    def wait_for_layer_load(self, layer_name: str) -> None:
        if self._worker is not None:
            self._worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: "torch.Tensor",
                      attn_metadata: "AttentionMetadata", **kwargs: Any) -> None:
        return  # wait_for_save copies every layer's blocks out after the forward

    @guarded(answer_none)
    def wait_for_save(self) -> None:
        if self._worker is None or not self.has_connector_metadata():
            return
        meta = self._get_connector_metadata()
        if isinstance(meta, KVKeeperConnectorMetadata):
            self._worker.wait_for_save(meta)

    def get_finished(self, finished_req_ids: set[str]) -> Tuple[Optional[set], Optional[set]]:
        # vLLM keeps the blocks of every request named here (request_finished
        # returned True) until it is answered, and fails on an answer it did
        # not wait for: answer exactly these, this step, whatever happens.
        notices = self._free_notices()
        if not notices:
            return None, None
        try:
            if self._worker is not None:
                self._worker.copy_out_for(notices)
        except Exception as e:  # noqa: BLE001 - copy_out never leaves a copy running
            self.hook_failures.failed("get_finished", e)
        return set(notices), None

    def _free_notices(self) -> set:
        if not self.has_connector_metadata():
            return set()
        meta = self._get_connector_metadata()
        return set(getattr(meta, "free_after_save", ()) or ())

    @guarded(answer_none)
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        preempted = getattr(kv_connector_metadata, "preempted", None)
        if preempted and self._worker is not None:
            self._worker.copy_out_for(set(preempted))

    @guarded(answer_all_loads_failed)
    def get_block_ids_with_load_errors(self) -> set[int]:
        if self._worker is None:
            return set()
        return self._worker.take_load_errors()

    @guarded(answer_none)
    def build_connector_worker_meta(self) -> Optional[KVConnectorWorkerMetadata]:
        if self._worker is None:
            return None
        return self._worker.build_worker_meta()

    @guarded(answer_none)
    def get_kv_connector_stats(self) -> "Optional[KVConnectorStats]":
        side = self._worker if self._worker is not None else self._sched
        return side.take_stats() if side is not None else None

    @guarded(answer_none)
    def bind_gpu_block_pool(self, gpu_block_pool: Any) -> None:
        if self._peer is not None:
            self._peer.bind_block_pool(gpu_block_pool)   # generations bumped on reuse

    @guarded(answer_none)
    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.shutdown()
        if self._sched is not None:
            self._sched.shutdown()
        if self._peer is not None:
            self._peer.close()

    # ==============================
    # Scheduler-side methods
    # ==============================

    @guarded(answer_none)
    def on_new_request(self, request: "Request") -> None:
        if self._sched is not None:
            self._sched.on_new_request(request)
            if self._residency is not None:
                self._residency.seen(request, self._sched.seeds)

    @guarded(answer_miss)
    def get_num_new_matched_tokens(self, request: "Request",
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        if self._sched is None:
            return 0, False
        return self._sched.get_num_new_matched_tokens(request, num_computed_tokens)

    @guarded(answer_none)
    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        if self._sched is not None:
            self._sched.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = self._build_meta(scheduler_output)
        # Outside the guard: a request whose free was delayed must reach the
        # workers even when planning this step failed, or its blocks leak.
        for req in meta.saves:
            self._saving.add(req.req_id)
        # A request whose saves wait for its loads' outcomes keeps its blocks
        # until those went out (load_gates.py): vLLM steps on only meanwhile.
        gates = self._sched.gates if self._sched is not None else None
        meta.free_after_save = {r for r in self._delayed if gates is None or not gates.held(r)}
        self._delayed -= meta.free_after_save
        meta.preempted = set(getattr(scheduler_output, "preempted_req_ids", None) or ())
        return meta

    @guarded(answer_empty_meta)
    def _build_meta(self, scheduler_output: "SchedulerOutput") -> KVKeeperConnectorMetadata:
        if self._sched is None:
            return KVKeeperConnectorMetadata()
        return self._sched.build_connector_meta(scheduler_output,
                                                self._block_ids_getter(scheduler_output))

    def _block_ids_getter(self, so: Any) -> Callable[[str], Optional[Sequence[Any]]]:
        state = getattr(so, "kv_connector_block_state", None)
        manager = self._kv_cache_manager

        def get(req_id: str) -> Optional[Sequence[Any]]:
            ids = state.get_block_ids(req_id) if state is not None else None
            if ids is None and manager is not None:
                ids = manager.get_block_ids(req_id)
            if not ids:
                return None
            # Several KV cache groups (hma.py): every group's block ids.
            return ids[0] if len(ids) == 1 else tuple(ids)

        return get

    def bind_kv_cache_manager(self, kv_cache_manager: "KVCacheManager") -> None:
        # The base class keeps the manager and calls bind_gpu_block_pool; then
        # the pool's KV cache events become residency reports (residency.py).
        super().bind_kv_cache_manager(kv_cache_manager)
        self._bind_residency(kv_cache_manager.block_pool)

    @guarded(answer_none)
    def _bind_residency(self, pool: Any) -> None:
        if self._sched is not None:
            self._residency = ResidencyReporter(self._sched.links, self._sched.bs,
                                                off=not self._sched.cfg.report_residency)
            self._residency.bind(pool)

    def get_external_cache_hit_sources(self, request: "Request",
                                       num_external_tokens: int) -> Dict[CacheHitSource, int]:
        """The hit's tokens per tier it came from (host, disk; hit_sources.py)."""
        if num_external_tokens <= 0:
            return {}
        try:
            split = self._sched.hit_sources(request) if self._sched is not None else {}
            if split and sum(split.values()) == num_external_tokens:
                return {CacheHitSource(src): n for src, n in split.items()}
        except Exception as e:  # noqa: BLE001 - a metric's split never fails a request
            self.hook_failures.failed("get_external_cache_hit_sources", e)
        return {self._cache_hit_source: num_external_tokens}

    @guarded(answer_none)
    def update_connector_output(self, connector_output: Any) -> None:
        if self._sched is not None:
            self._sched.update_connector_output(connector_output)

    @guarded(answer_not_delayed)
    def request_finished(self, request: "Request",
                         block_ids: List[int]) -> Tuple[bool, Optional[Dict[str, Any]]]:
        # A request that planned saves may still have blocks queued for a
        # worker's save thread: keep them until the workers answer
        # (get_finished), whatever else fails here, or vLLM could hand them
        # to another request while a save still copies them.
        rid = request.request_id
        report = None
        try:
            report = self._sched.request_finished(request) if self._sched is not None else None
        except Exception as e:  # noqa: BLE001 - the delay below must still be answered
            self.hook_failures.failed("request_finished", e)
        if rid not in self._saving:
            return False, report
        self._saving.discard(rid)
        self._delayed.add(rid)   # last: nothing after it can fail and return False
        return True, report

    # ==============================
    # Stats
    # ==============================

    @classmethod
    def build_kv_connector_stats(cls, data: Optional[Dict[str, Any]] = None
                                 ) -> "Optional[KVConnectorStats]":
        return KVKeeperStats(data=dict(data) if data else {})

    @classmethod
    def build_prom_metrics(cls, vllm_config: "VllmConfig", metric_types: Any,
                           labelnames: List[str],
                           per_engine_labelvalues: Dict[int, List[object]]) -> Any:
        return KVKeeperPromMetrics(vllm_config, metric_types, labelnames, per_engine_labelvalues)
