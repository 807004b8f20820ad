"""Several KV cache groups (vLLM's hybrid allocator): one worker side per group.

With interleaved sliding-window and full-attention layers (Gemma-2/3), or a
sliding window that vLLM frees behind itself (Mistral), vLLM's hybrid memory
allocator gives each group of layers its own block table. A kvkeeper block
is then one group's layers of one block of tokens, in a namespace of its own
(layout.py: the group's spec, window and index are in kv_layout, its layer
names in the byte order), and each (TP rank, group) is a slot: one daemon
session, one key chain, one WorkerSide with its own codec over the group's
layers only. The scheduler side treats slots as it treats TP ranks:

* a hit counts only where every slot holds its blocks (the lookup's answer
  is the minimum over slots);
* a sliding-window group loads only the blocks vLLM allocated for the hit,
  the ones inside the window of the next token: vLLM puts its null block
  (id 0) at the positions before it, and those are skipped here (they count
  as loaded: vLLM never reads them);
* it saves the blocks vLLM still holds when they are full (all of a step's
  computed blocks: vLLM frees the ones that left the window on a later
  step), never the null block. Since vLLM frees them while the request
  runs, a sliding-window group's queued saves are copied out before the
  next forward (handle_preemptions runs before every forward), not only
  when the request ends;
* loads are asynchronous (SchedulerSide answers load_kv_async), because
  vLLM takes no per-block load failures from a connector with several
  groups (it raises): a load that fails on any slot fails its request
  (failed_recving), which vLLM recomputes from the start.
"""
from __future__ import annotations

from dataclasses import replace
from typing import Any, Dict, Mapping, Optional, Sequence, Set, Tuple

from .metadata import KVKeeperConnectorMetadata, KVKeeperWorkerMetadata, LoadSpec, SaveSpec
from .stats import KVKeeperStats
from .worker import WorkerSide

__all__ = ["NULL_BLOCK", "GroupedWorker", "group_load", "group_save", "grouped_results",
           "slot_of"]

NULL_BLOCK = 0   # vLLM's null block: a position a sliding-window group does not hold


def slot_of(rank: int, group: int, groups: int) -> int:
    """The index of (TP rank, KV cache group) among the namespaces and sessions."""
    return rank * groups + group


def _ids(spec: Any, group: int) -> Tuple[int, ...]:
    return tuple(spec.group_block_ids[group]) if spec.group_block_ids else tuple(spec.block_ids)


def group_load(spec: LoadSpec, group: int) -> Tuple[LoadSpec, int]:
    """Group `group`'s part of a load: its block ids, less the leading null
    blocks (outside the window), up to any later null block (not expected:
    the blocks after it are then not loaded, so the load fails there).
    Returns (that load, positions skipped at the front)."""
    ids = _ids(spec, group)
    skip = 0
    while skip < len(ids) and ids[skip] == NULL_BLOCK:
        skip += 1
    end = skip
    while end < len(ids) and ids[end] != NULL_BLOCK:
        end += 1
    # A peer's entries pair with the blocks position by position: cut them alike.
    peer = None if spec.peer is None else (spec.peer[0], tuple(spec.peer[1][skip:end]))
    return replace(spec, keys=tuple(tuple(k[skip:end]) for k in spec.keys),
                   block_ids=ids[skip:end], refs=tuple(tuple(r[skip:end]) for r in spec.refs),
                   group_block_ids=(), peer=peer), skip


def group_save(spec: SaveSpec, group: int) -> SaveSpec:
    """Group `group`'s part of a save: the blocks it holds (not the null block)."""
    ids = _ids(spec, group)
    keep = [i for i, b in enumerate(ids) if b != NULL_BLOCK]
    return replace(spec, keys=tuple(tuple(k[i] for i in keep) for k in spec.keys),
                   block_ids=tuple(ids[i] for i in keep), group_block_ids=())


class GroupedWorker:
    """One TP rank's WorkerSides, one per KV cache group (workers[g] serves
    slot slot_of(rank, g, groups)), behind the WorkerSide calls connector.py
    makes, and the asynchronous loads' results for get_transfer_results."""

    def __init__(self, workers: Sequence[WorkerSide]) -> None:
        if not workers:
            raise ValueError("a grouped worker needs a worker per KV cache group")
        self.workers = list(workers)
        # load id -> (request, {slot: (positions skipped at the front, blocks of the load)})
        self._loads: Dict[int, Tuple[str, Dict[int, Tuple[int, int]]]] = {}
        # load id -> {slot: (leading blocks loaded, corrupt positions)}, of the whole load
        self._done: Dict[int, Dict[int, Tuple[int, Tuple[int, ...]]]] = {}
        # load id -> {slot: leading blocks loaded}, until transfer_results answers it
        self._good: Dict[int, Dict[int, int]] = {}

    # ---- set-up

    def register_kv_caches(self, kv_caches: Mapping[str, Any], num_blocks: int) -> None:
        for w in self.workers:
            names = w.layout.layer_names if w.layout is not None else ()
            w.register_kv_caches({n: kv_caches[n] for n in names if n in kv_caches}, num_blocks)

    # ---- loads

    def _sub_meta(self, meta: KVKeeperConnectorMetadata, g: int, w: WorkerSide,
                  saves: bool) -> KVKeeperConnectorMetadata:
        sub = KVKeeperConnectorMetadata()
        for spec in meta.loads:
            part, skip = group_load(spec, g)
            sub.loads.append(part)
            if not saves:
                self._loads.setdefault(spec.load_id, (spec.req_id, {}))[1][w.rank] = \
                    (skip, spec.num_blocks())
        if saves:
            sub.saves = [group_save(s, g) for s in meta.saves]
        return sub

    def start_load_kv(self, meta: KVKeeperConnectorMetadata) -> None:
        for g, w in enumerate(self.workers):
            w.start_load_kv(self._sub_meta(meta, g, w, saves=False))

    def wait_for_layer_load(self, layer_name: str) -> None:
        for w in self.workers:
            w.wait_for_layer_load(layer_name)

    def fail_loads(self, meta: Any) -> None:
        for g, w in enumerate(self.workers):
            w.fail_loads(self._sub_meta(meta, g, w, saves=False))

    def _collect(self) -> None:
        for w in self.workers:
            for load_id, ranks in w.take_results().items():
                entry = self._loads.get(load_id)
                for slot, (good, bad) in ranks.items():
                    skip = entry[1].get(slot, (0, 0))[0] if entry else 0
                    self._done.setdefault(load_id, {})[slot] = \
                        (skip + good, tuple(skip + b for b in bad))
                    self._good.setdefault(load_id, {})[slot] = skip + good

    def transfer_results(self) -> Tuple[Set[str], Set[str]]:
        """(requests whose loads finished on every group, the ones of them that
        failed on any), since the last call: vLLM's finished_recving and
        failed_recving."""
        self._collect()
        finished: Set[str] = set()
        failed: Set[str] = set()
        for load_id, (req_id, slots) in list(self._loads.items()):
            good = self._good.get(load_id, {})
            if any(slot not in good for slot in slots):
                continue
            del self._loads[load_id]
            self._good.pop(load_id, None)
            finished.add(req_id)
            if any(good[slot] < n for slot, (_, n) in slots.items()):
                failed.add(req_id)
        return finished, failed

    def take_load_errors(self) -> Set[int]:
        # Never block ids: vLLM raises on them with several groups. A failed
        # load is its request's failed_recving (transfer_results).
        self._collect()
        return set()

    def build_worker_meta(self) -> Optional[KVKeeperWorkerMetadata]:
        self._collect()
        disabled: Dict[int, str] = {}
        for w in self.workers:
            m = w.build_worker_meta()
            if m is not None:
                disabled.update(m.disabled)
        done, self._done = self._done, {}
        if not done and not disabled:
            return None
        return KVKeeperWorkerMetadata(loads_done=done, disabled=disabled)

    # ---- saves

    def wait_for_save(self, meta: KVKeeperConnectorMetadata) -> None:
        if not meta.saves:
            return
        for g, w in enumerate(self.workers):
            w.wait_for_save(self._sub_meta(KVKeeperConnectorMetadata(saves=meta.saves), g, w,
                                           saves=True))

    def before_forward(self) -> None:
        """Copy out the sliding-window groups' queued saves: their blocks that
        left the window were freed when this step was scheduled."""
        for w in self.workers:
            if w.layout is not None and w.layout.sliding:
                w.copy_out_all()

    def copy_out_for(self, req_ids: Set[str]) -> None:
        for w in self.workers:
            w.copy_out_for(req_ids)

    # ---- the rest

    def take_stats(self) -> Optional[KVKeeperStats]:
        out: Optional[KVKeeperStats] = None
        for w in self.workers:
            s = w.take_stats()
            if s is not None:
                out = s if out is None else out.aggregate(s)
        return out

    def flush(self, timeout: float) -> bool:
        return all([w.flush(timeout) for w in self.workers])

    def shutdown(self) -> None:
        for w in self.workers:
            w.shutdown()


def grouped_results(worker: Any) -> Tuple[Set[str], Set[str]]:
    """transfer_results of a GroupedWorker; nothing for any other worker."""
    if isinstance(worker, GroupedWorker):
        return worker.transfer_results()
    return set(), set()

