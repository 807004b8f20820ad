"""KVKeeperHMAConnector: the connector with vLLM's hybrid memory allocator.

KVKeeperConnector does not declare SupportsHMA, so vLLM turns its hybrid
allocator off: sliding-window layers (Mistral, Gemma-2/3's interleaved
ones) then run as full attention in one KV cache group, every block kept
for the whole request, and hybrid attention/Mamba models do not start.
This class declares SupportsHMA: vLLM keeps one KV cache group per kind of
layer (and frees a sliding window's blocks behind it), and the connector
serves each group in a namespace of its own (groups.py says how). Groups
whose state is not per-token attention KV (Mamba, linear attention) are
refused at start-up: the connector disables itself with that reason in the
log and vLLM runs without it.

    --kv-transfer-config '{"kv_connector": "KVKeeperHMAConnector",
                           "kv_connector_module_path": "kvkeeper.connector", ...}'
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Dict, List, Optional, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                               KVConnectorTransferResults,
                                                               SupportsHMA)

from .connector import KVKeeperConnector
from .groups import grouped_results
from .guard import answer_none, guarded
from .layout import layouts_from_config

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

__all__ = ["KVKeeperHMAConnector"]


class KVKeeperHMAConnector(KVKeeperConnector, SupportsHMA):
    """KVKeeperConnector for engines with several KV cache groups."""

    serves_hybrid_allocator = True

    @staticmethod
    def kv_layouts(vllm_config: "VllmConfig", kv_cache_config: "KVCacheConfig | None") -> Any:
        return layouts_from_config(vllm_config, kv_cache_config)

    def request_finished_all_groups(self, request: "Request", block_ids: Tuple[List[int], ...]
                                    ) -> Tuple[bool, Optional[Dict[str, Any]]]:
        # The scheduler side keeps no block ids of its own at the end: the
        # saves were planned with every group's ids (save_plan.py).
        return self.request_finished(request, list(block_ids[0]) if block_ids else [])

    @guarded(answer_none)
    def handle_preemptions(self, kv_connector_metadata: KVConnectorMetadata) -> None:
        super().handle_preemptions(kv_connector_metadata)
        before = getattr(self.worker_side, "before_forward", None)
        if before is not None:
            before()   # sliding-window groups: copy queued saves out first

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        sending, _ = self.get_finished(finished_req_ids)
        try:
            recving, failed = grouped_results(self.worker_side)
        except Exception as e:  # noqa: BLE001 - never into vLLM
            self.hook_failures.failed("get_transfer_results", e)
            recving, failed = set(), set()
        return KVConnectorTransferResults(finished_sending=set(sending or ()),
                                          finished_recving=recving, failed_recving=failed)
