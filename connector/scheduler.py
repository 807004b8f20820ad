"""Scheduler-side logic: lookups with leases, load plans, save plans, releases.

Timeline of one request (see the seed notes on UCM's, which this follows):

1. get_num_new_matched_tokens: the keys of the prompt's full blocks beyond
   what vLLM has locally are looked up with Match(lease=True): the hit is
   pinned in the daemon until the load is done. At most
   (num_tokens - 1) rounded down to a block boundary is ever reported, so
   vLLM always computes the last token. Any failure is a miss, counted.
2. update_state_after_alloc: the vLLM block ids that receive the hit are
   recorded as a LoadSpec.
3. build_connector_meta: the step's LoadSpecs, and a SaveSpec for every full
   block the step computes (prefill chunks and blocks filled by decoding)
   that is not known to be in the daemon yet.
4. update_connector_output: the workers report each load done (and whether
   a block was corrupt); the lease is released then (with discard=True for a
   corrupt block, so the daemon drops it).
5. request_finished: whatever lease is still held is released (abort,
   preemption, a load never reported). Saves never delay the free: workers
   copy a step's blocks out of the KV cache before the step ends (see
   worker.py), so vLLM may reuse them as soon as the request is done.

The scheduler and the workers run in different processes (even at TP=1 on
vLLM's multiprocess executor) and a lease belongs to the session that took
it, so a worker loads by matching the same keys under its own short lease;
the scheduler's lease guarantees the blocks are still there when it does.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from .config import ConnectorConfig
from .keys import KeyChain, matchable_blocks, namespace_seed
from .layout import KVLayout
from .link import DaemonLink, LinkDown
from .metadata import KVKeeperConnectorMetadata, KVKeeperWorkerMetadata, LoadSpec, SaveSpec
from .releaser import Releaser
from .stats import Counters, KVKeeperStats

__all__ = ["SchedulerSide", "request_seed_inputs"]

log = logging.getLogger("kvkeeper.connector")


def request_seed_inputs(request: Any) -> Tuple[Optional[str], Optional[str], List[str]]:
    """(cache_salt, lora tag, multimodal identities) of a vLLM Request: what,
    besides the tokens and the namespace, changes a request's KV."""
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    tag = None
    if lora is not None:
        name = getattr(lora, "lora_name", None) or getattr(lora, "name", None)
        tag = str(name) if name else f"id:{getattr(lora, 'lora_int_id', '')}"
    mm: List[str] = []
    for f in getattr(request, "mm_features", None) or ():
        pos = getattr(f, "mm_position", None)
        off = getattr(pos, "offset", "")
        length = getattr(pos, "length", "")
        mm.append(f"{getattr(f, 'identifier', '')}@{off}+{length}")
    return salt, tag, mm


@dataclass
class _Lease:
    ids: List[Optional[int]]   # per TP rank; None where that rank matched nothing
    start: int                 # first block (index in the request) the lease covers
    blocks: int                # leading blocks matched on every rank


@dataclass
class _Req:
    request: Any
    chains: List[KeyChain]
    cacheable: bool
    lease: Optional[_Lease] = None
    saved_blocks: Optional[int] = None   # leading blocks stored or planned; None: unknown yet
    hit_tokens: int = 0
    saved_total: int = 0
    loads: Set[int] = field(default_factory=set)   # load ids in flight


class SchedulerSide:
    """Everything the scheduler-role connector does; `links[r]` is TP rank r's session."""

    def __init__(self, cfg: ConnectorConfig, layout: KVLayout, namespaces: Sequence[Dict[str, Any]],
                 links: Sequence[DaemonLink], counters: Optional[Counters] = None,
                 releasers: Optional[Sequence[Releaser]] = None) -> None:
        if len(namespaces) != len(links) or not links:
            raise ValueError("one namespace and one link per TP rank")
        self.cfg = cfg
        self.layout = layout
        self.bs = layout.block_tokens
        self.namespaces = [dict(ns) for ns in namespaces]
        self.links = list(links)
        self.releasers = list(releasers) if releasers is not None else [Releaser(l) for l in links]
        self.counters = counters or Counters()
        self._reqs: Dict[str, _Req] = {}
        self._pending_loads: List[Tuple[str, LoadSpec, _Lease]] = []
        self._inflight: Dict[int, Tuple[str, _Lease]] = {}   # load id -> (req id, lease)
        self._next_load_id = 1
        self.loads_disabled: Optional[str] = None   # set when a worker cannot load

    # ---- per-request state

    def _state(self, request: Any) -> _Req:
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None or st.request is not request:
            salt, lora, mm = request_seed_inputs(request)
            cacheable = getattr(request, "prompt_embeds", None) is None
            chains = [KeyChain(namespace_seed(ns, cache_salt=salt, lora=lora, extra=mm), self.bs)
                      for ns in self.namespaces]
            st = _Req(request=request, chains=chains, cacheable=cacheable)
            self._reqs[rid] = st
        return st

    def _keys(self, st: _Req, rank: int, start: int, end: int) -> Tuple[bytes, ...]:
        return tuple(st.chains[rank].keys(st.request.all_token_ids, end)[start:end])

    def _release(self, lease: Optional[_Lease], discard_ranks: Set[int] = frozenset()) -> None:
        if lease is None:
            return
        for rank, lid in enumerate(lease.ids):
            if lid:
                self.releasers[rank].release(lid, discard=rank in discard_ranks)

    def _drop_lease(self, st: _Req) -> None:
        lease, st.lease = st.lease, None
        self._release(lease)

    # ---- vLLM hooks

    def on_new_request(self, request: Any) -> None:
        self._state(request)

    def get_num_new_matched_tokens(self, request: Any, num_computed_tokens: int) -> Tuple[int, bool]:
        st = self._state(request)
        # Called again for the same request (not scheduled last time, or resumed
        # after preemption): the earlier lease and save progress are stale.
        self._drop_lease(st)
        st.saved_blocks = None
        if (not self.cfg.load or not st.cacheable or self.loads_disabled
                or getattr(request, "skip_reading_prefix_cache", False)):
            return 0, False
        bs = self.bs
        start = num_computed_tokens // bs
        limit = matchable_blocks(request.num_tokens, bs)
        if limit <= start:
            return 0, False
        matched = limit - start
        ids: List[Optional[int]] = []
        try:
            for rank, link in enumerate(self.links):
                keys = list(self._keys(st, rank, start, limit))
                res = link.call(lambda c: c.match(keys, lease=True), "lookup")
                ids.append(res.lease_id)
                matched = min(matched, res.matched)
                if matched == 0:
                    break
        except Exception as e:
            self._release(_Lease(ids, start, 0))
            self.counters.inc("lookup_errors")
            if not isinstance(e, LinkDown):
                log.debug("kvkeeper: lookup of %s failed: %s", request.request_id, e)
            return 0, False
        self.counters.inc("lookups")
        self.counters.inc("lookup_tokens", (limit - start) * bs)
        lease = _Lease(ids, start, matched)
        if matched == 0:
            self._release(lease)
            return 0, False
        st.lease = lease
        return matched * bs, False

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        lease = st.lease
        n = num_external_tokens // self.bs
        if n <= 0 or lease is None:
            self._drop_lease(st)
            return
        st.lease = None
        try:
            block_ids = list(blocks.get_block_ids()[0])
            n = lease.blocks = min(n, lease.blocks)
            targets = tuple(block_ids[lease.start:lease.start + n])
            if len(targets) != n:
                raise ValueError(f"request has {len(block_ids)} blocks, the load needs "
                                 f"[{lease.start}, {lease.start + n})")
            keys = tuple(self._keys(st, r, lease.start, lease.start + n)
                         for r in range(len(self.links)))
        except Exception as e:
            # vLLM now counts these tokens as loaded: a load that names no keys
            # makes the worker report every target block as failed, so vLLM
            # recomputes them instead of reading whatever the blocks hold.
            log.error("kvkeeper: planning the load of %s failed (%s); its hit will be "
                      "recomputed", request.request_id, e)
            keys = tuple(() for _ in self.links)
            try:
                targets = tuple(list(blocks.get_block_ids()[0])[lease.start:lease.start + n])
            except Exception:
                targets = ()
        load = LoadSpec(req_id=request.request_id, keys=keys, block_ids=targets,
                        load_id=self._next_load_id)
        self._next_load_id += 1
        self._pending_loads.append((request.request_id, load, lease))
        st.hit_tokens += n * self.bs
        self.counters.inc("hit_tokens", n * self.bs)

    def build_connector_meta(self, scheduler_output: Any,
                             block_ids_of: Callable[[str], Optional[Sequence[int]]]
                             ) -> KVKeeperConnectorMetadata:
        meta = KVKeeperConnectorMetadata()
        # Loads first and unconditionally: vLLM already counts them as computed.
        for req_id, load, lease in self._pending_loads:
            meta.loads.append(load)
            self._inflight[load.load_id] = (req_id, lease)
            st = self._reqs.get(req_id)
            if st is not None:
                st.loads.add(load.load_id)
        self._pending_loads = []
        if self.cfg.save:
            try:
                self._plan_saves(scheduler_output, block_ids_of, meta)
            except Exception as e:  # a missed save is a future miss, nothing worse
                log.warning("kvkeeper: planning this step's saves failed: %s", e, exc_info=True)
        return meta

    def _plan_saves(self, so: Any, block_ids_of: Callable[[str], Optional[Sequence[int]]],
                    meta: KVKeeperConnectorMetadata) -> None:
        bs = self.bs
        spec_tokens = getattr(so, "scheduled_spec_decode_tokens", None) or {}
        for req_id, scheduled in so.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None or not st.cacheable:
                continue
            req = st.request
            before = req.num_computed_tokens   # not yet advanced by this step
            if st.saved_blocks is None:
                st.saved_blocks = before // bs
            # Draft tokens may be rejected: their KV is not final.
            after = before + scheduled - len(spec_tokens.get(req_id, ()))
            full = min(after, req.num_tokens) // bs
            if full <= st.saved_blocks:
                continue
            ids = block_ids_of(req_id)
            if ids is None or len(ids) < full:
                log.debug("kvkeeper: %s holds %s blocks, %d are full; not saving this step",
                          req_id, None if ids is None else len(ids), full)
                continue
            start = st.saved_blocks
            keys = tuple(self._keys(st, r, start, full) for r in range(len(self.links)))
            meta.saves.append(SaveSpec(req_id=req_id, keys=keys,
                                       block_ids=tuple(ids[start:full])))
            st.saved_blocks = full
            st.saved_total += full - start

    def update_connector_output(self, connector_output: Any) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KVKeeperWorkerMetadata):
            return
        if wm.disabled and not self.loads_disabled:
            self.loads_disabled = "; ".join(sorted(set(wm.disabled.values())))
            log.error("kvkeeper: a worker cannot load blocks (%s); lookups are off for this "
                      "engine, saves too", self.loads_disabled)
            self.cfg = _without_io(self.cfg)
        for load_id, ranks in wm.loads_done.items():
            entry = self._inflight.pop(load_id, None)
            if entry is None:
                continue
            req_id, lease = entry
            st = self._reqs.get(req_id)
            good = min((g for g, _ in ranks.values()), default=0)
            corrupt = {r for r, (_, bad) in ranks.items() if bad}
            if st is not None:
                st.loads.discard(load_id)
                if st.saved_blocks is not None:
                    if corrupt:
                        # Release(discard) drops every block of the lease: save
                        # them all again, the good ones from what was loaded and
                        # the rest once vLLM has recomputed them.
                        st.saved_blocks = min(st.saved_blocks, lease.start)
                    elif good < lease.blocks:
                        # vLLM recomputes from the first block that failed.
                        st.saved_blocks = min(st.saved_blocks, lease.start + good)
            self._release(lease, corrupt)
            if corrupt:
                # Rare: let the discard reach the daemon before this request's
                # blocks are saved again (else they would find the corrupt
                # block still present, skip it, and then see it dropped).
                for r in corrupt:
                    self.releasers[r].flush(self.cfg.lookup_timeout_s)

    def request_finished(self, request: Any) -> Optional[Dict[str, Any]]:
        """Release what the request still holds; the report for kv_transfer_params."""
        st = self._reqs.pop(request.request_id, None)
        if st is None:
            return None
        self._drop_lease(st)
        for load_id in st.loads:
            entry = self._inflight.pop(load_id, None)
            if entry is not None:
                self._release(entry[1])
        if not self.cfg.report:
            return None
        return {"kvkeeper": {
            "hit_tokens": st.hit_tokens,
            "saved_blocks": st.saved_total,
            "block_tokens": self.bs,
            "namespace": self.namespaces[0],
            "seed": st.chains[0].seed.hex(),
        }}

    def take_stats(self) -> Optional[KVKeeperStats]:
        return self.counters.take()

    def held_leases(self) -> int:
        """Leases taken and not yet handed to a releaser (for tests and logs)."""
        n = sum(1 for st in self._reqs.values() if st.lease is not None)
        return n + len(self._inflight) + len(self._pending_loads)

    def shutdown(self) -> None:
        for st in self._reqs.values():
            self._drop_lease(st)
        for _, lease in self._inflight.values():
            self._release(lease)
        self._inflight.clear()
        for r in self.releasers:
            r.close(timeout=2.0)
        for link in self.links:
            link.close()


def _without_io(cfg: ConnectorConfig) -> ConnectorConfig:
    from dataclasses import replace
    return replace(cfg, load=False, save=False)
