"""What the scheduler-side connector tells the workers each step, and back.

Scheduler -> workers (KVKeeperConnectorMetadata, one per step):
  loads: blocks the scheduler promised vLLM (a hit), by key, and the vLLM
         block ids that receive them, with where they lie in the daemon's
         shared memory; the worker loads them before the forward.
  saves: full blocks that this step computes, by key, and their vLLM block
         ids; after the forward the worker queues them: a connector thread
         copies them out of the KV cache and stores them.
  free_after_save: requests that finished since the last step and whose
         blocks vLLM keeps because request_finished returned True (they had
         saves); the worker makes sure their blocks are copied out and
         answers them in get_finished, so vLLM frees the blocks this step.
  preempted: requests vLLM preempted while scheduling this step; their
         blocks may be rewritten by this very forward, so the worker finishes
         copying them out first (handle_preemptions).
  load_outcomes: load_id -> whether every rank loaded every block of it,
         for the loads whose reports came since the last step. A save of
         blocks computed in a loading step (SaveSpec.after_loads) attends to
         the loaded blocks: the save thread stores it only once its loads
         are known clean, and drops it otherwise (a failed load makes it
         wrong KV, and the recompute's save would find its key present).
Keys are per TP rank (keys[rank]): every rank has its own namespace; with
several KV cache groups per (rank, group) slot, rank * groups + group.

Workers -> scheduler (KVKeeperWorkerMetadata): which loads finished and
which blocks a rank found corrupt, so the scheduler releases its lease at
once (discarding those blocks) instead of at the end of the request.

All of it is plain data: it is pickled between processes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Set, Tuple

from vllm.distributed.kv_transfer.kv_connector.v1.base import (KVConnectorMetadata,
                                                               KVConnectorWorkerMetadata)

__all__ = ["LoadSpec", "SaveSpec", "KVKeeperConnectorMetadata", "KVKeeperWorkerMetadata"]


@dataclass
class LoadSpec:
    req_id: str
    keys: Tuple[Tuple[bytes, ...], ...]   # [tp_rank][i]: key of the i-th block to load
    block_ids: Tuple[int, ...]            # vLLM block receiving block i
    load_id: int = 0                      # names the load in KVKeeperWorkerMetadata
    # vLLM computes the last token of the last block itself (a hit of every
    # token but the prompt's last): this step's forward writes into that
    # block, so the worker checks it before the forward runs.
    recomputes_last: bool = False
    # Where the blocks lie in the daemon's shared memory, per TP rank, from
    # the scheduler's leased Match (its lease keeps them there until the
    # worker reports the load): the worker copies them without an RPC of its
    # own when it maps the same arena (arena_ids[rank]). Empty: Match itself.
    # [tp_rank][i]: (checksum_algo, checksum, extents) of the block's BlockRef
    # (client.copies.stored): plain data, since this travels pickled on the
    # step's critical path, where 64 protobuf BlockRefs cost ~365 us (pickled
    # in the engine core, unpickled in the worker) and their tuples ~30 us.
    refs: Tuple[Tuple[Any, ...], ...] = ()
    arena_ids: Tuple[Optional[bytes], ...] = ()
    # From a same-host peer's KV cache instead of the daemon (TP 1 only):
    # (the peer's segment, (block, generation) there of each block to load).
    peer: Optional[Tuple[str, Tuple[Tuple[int, int], ...]]] = None
    # Several KV cache groups (connector/groups.py): [group][i], the vLLM block
    # of block i in each group (block_ids is group 0's); 0, vLLM's null block,
    # where a sliding-window group holds nothing. Empty with one group.
    group_block_ids: Tuple[Tuple[int, ...], ...] = ()

    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass
class SaveSpec:
    req_id: str
    keys: Tuple[Tuple[bytes, ...], ...]   # [tp_rank][i]
    block_ids: Tuple[int, ...]            # vLLM block holding block i after this step
    # [tp_rank]: the key before keys[rank][0] in the request's chain (b"":
    # the chain's first block); empty: not known (ReserveSave's parent_key).
    parents: Tuple[bytes, ...] = ()
    group_block_ids: Tuple[Tuple[int, ...], ...] = ()   # [group][i], as in LoadSpec
    # Loads in flight for this request when the step computed these blocks:
    # stored only once all of them are reported clean (load_outcomes).
    after_loads: Tuple[int, ...] = ()

    def num_blocks(self) -> int:
        return len(self.block_ids)


@dataclass
class KVKeeperConnectorMetadata(KVConnectorMetadata):
    loads: List[LoadSpec] = field(default_factory=list)
    saves: List[SaveSpec] = field(default_factory=list)
    free_after_save: Set[str] = field(default_factory=set)
    preempted: Set[str] = field(default_factory=set)
    load_outcomes: Dict[int, bool] = field(default_factory=dict)

    def is_empty(self) -> bool:
        return not (self.loads or self.saves or self.free_after_save or self.preempted
                    or self.load_outcomes)


@dataclass
class KVKeeperWorkerMetadata(KVConnectorWorkerMetadata):
    # load_id -> {tp_rank: (leading blocks loaded, indices in the LoadSpec of
    # the blocks that failed their checksum: empty when none did)}
    loads_done: Dict[int, Dict[int, Tuple[int, Tuple[int, ...]]]] = field(default_factory=dict)
    # tp_rank -> why that worker cannot load (its KV tensors do not match)
    disabled: Dict[int, str] = field(default_factory=dict)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> "KVKeeperWorkerMetadata":
        if isinstance(other, KVKeeperWorkerMetadata):
            for load_id, ranks in other.loads_done.items():
                mine = self.loads_done.setdefault(load_id, {})
                mine.update(ranks)   # each rank reports only its own entry
            self.disabled.update(other.disabled)
        return self
