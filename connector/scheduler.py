"""Scheduler-side logic: lookups with leases, load plans, save plans, releases.

Timeline of one request (as the seed notes on UCM's):
1. on_new_request (vLLM adds the request, before scheduling it): the keys of the prompt's
   full blocks, from block 0, are looked up with Match(lease=True, report_use=True) on
   each TP rank's link thread (DaemonLink.submit): the hit is pinned in the daemon until
   the load is done, and the scheduler thread never waits for the daemon. vLLM has not
   said yet how much of the prompt its own prefix cache holds, so the daemon counts no
   hit for this Match: every lease's release (or, for a lookup that leased nothing, a
   release of lease 0) carries a LookupReport of the prompt, the blocks vLLM held itself
   and the blocks loaded (see kvkeeper.server.ledger.usage); a lookup whose answer vLLM
   never used reports nothing, as vLLM counts nothing for it either.
2. get_num_new_matched_tokens: the answer is used if it is there, after waiting at most
   kvkeeper_lookup_wait_s (in all, per scheduling step), or IDLE_WAIT_S while no request
   is running (a skipped step would run nothing); else the answer is "pending" (None):
   vLLM skips the request this step and asks again on the next. A lookup not answered
   within kvkeeper_lookup_timeout_s, or failed, is a miss, counted. The hit reported is
   what the daemon holds beyond vLLM's own prefix-cache hit, and at most num_tokens - 1
   tokens: when the block holding the last token is held too it is loaded whole and vLLM
   computes only that token, writing its KV over the loaded copy during the forward
   (equal up to rounding, not always bit for bit). The leases are narrowed to the blocks
   beyond vLLM's own hit (Release with keep_blocks, queued like releases), so the daemon
   pins only what may be loaded.
3. update_state_after_alloc: the vLLM block ids that receive the hit go into a LoadSpec.
4. build_connector_meta: the step's LoadSpecs, and a SaveSpec for every full block the step
   computes (prefill chunks, blocks filled by decoding) not known to be in the daemon.
5. update_connector_output: the workers report each load done (and whether a block was
   corrupt); the lease is released then (discarding the corrupt blocks, so the daemon
   drops them).
6. request_finished: whatever lease is still held is released (abort, preemption, a load
   never reported), and a lookup still pending releases its lease when it lands. A
   request that planned saves has its free delayed (connector.py) until every worker has
   copied its blocks out of the KV cache (see save.py), the next step.

A request asked again after its answer was used (not scheduled, or resumed after
preemption) drops its lease and is looked up again; a pending lookup never starts twice.
Workers run in other processes and a lease is its session's, so a worker loads by
matching the same keys under its own short lease (the scheduler's keeps the blocks
there). A lookup answered short may find the prompt in a same-host peer's cache (peer/).
"""
from __future__ import annotations

import logging
import time
from concurrent.futures import Future
from dataclasses import replace
from typing import Any, Callable, Dict, List, Optional, Sequence, Set, Tuple

from kvkeeper.client.copies import stored

from .config import ConnectorConfig
from .hit_sources import lease_sources
from .keys import KeyChain, RequestSeeds, hit_tokens, matchable_blocks
from .layout import KVLayout
from .link import DaemonLink, LinkDown
from .load_gates import LoadGates
from .lookup import Lease, Lookup, match_with_refs, peer_lease, use_report, wait_all
from .metadata import KVKeeperConnectorMetadata, KVKeeperWorkerMetadata, LoadSpec
from .releaser import Releaser
from .save_plan import plan_saves
from .sched_state import RequestState, request_seed_inputs
from .stats import Counters, KVKeeperStats

__all__ = ["IDLE_WAIT_S", "SchedulerSide"]

# The longest get_num_new_matched_tokens waits for a lookup while no request runs (a step
# skipped then runs nothing), and update_connector_output for a corrupt block's discard.
IDLE_WAIT_S = 0.05

log = logging.getLogger("kvkeeper.connector")


class SchedulerSide:
    """Everything the scheduler-role connector does; `links[r]` is TP rank r's session."""

    def __init__(self, cfg: ConnectorConfig, layout: KVLayout, namespaces: Sequence[Dict[str, Any]],
                 links: Sequence[DaemonLink], counters: Optional[Counters] = None,
                 releasers: Optional[Sequence[Releaser]] = None,
                 clock: Callable[[], float] = time.monotonic,
                 wait: Optional[Callable[[Sequence[Future[Any]], float], Any]] = None,
                 peer: Optional[Callable[[Any, List[bytes], int], Any]] = None,
                 groups: int = 1, async_loads: bool = False) -> None:
        if len(namespaces) != len(links) or not links or len(links) % groups:
            raise ValueError("one namespace and one link per TP rank (and KV cache group)")
        # Several KV cache groups (connector/groups.py): a "rank" below is a
        # (TP rank, group) slot. Under vLLM's hybrid allocator loads are
        # asynchronous: vLLM takes no per-block load failures then.
        self.groups = groups
        self.async_loads = async_loads
        self.cfg = cfg
        self.layout = layout
        self.bs = layout.block_tokens
        self.namespaces = [dict(ns) for ns in namespaces]
        self.seeds = RequestSeeds(self.namespaces)   # each request's, per namespace
        self.links = list(links)
        self.releasers = list(releasers) if releasers is not None else [Releaser(l) for l in links]
        self.counters = counters or Counters()
        self._reqs: Dict[str, RequestState] = {}
        self._pending_loads: List[Tuple[str, LoadSpec, Lease]] = []
        self._inflight: Dict[int, Tuple[str, Lease]] = {}   # load id -> (req id, lease)
        self.gates = LoadGates()   # their outcomes, for the saves that wait for them
        self._next_load_id = 1
        self.loads_disabled: Optional[str] = None   # set when a worker cannot load
        self._clock = clock
        # wait(futures, timeout): returns when all are done or timeout seconds passed
        self._wait = wait or wait_all
        self._wait_left = cfg.lookup_wait_s   # of this scheduling step
        # Requests whose lookup vLLM has had an answer to (running, or about
        # to be): while there is none, a step that skips a pending request
        # runs nothing at all (see _wait_for).
        self._answered: Set[str] = set()
        self._peer = peer if len(self.links) == 1 else None   # peer/sched.py (TP 1)

    # ---- per-request state

    def _state(self, request: Any) -> RequestState:
        rid = request.request_id
        st = self._reqs.get(rid)
        if st is None or st.request is not request:
            if st is not None:   # another Request object under the same id: forget the old one
                self._forget_lookup(st)
                self._drop_lease(st)
            salt, lora, mm = request_seed_inputs(request)
            cacheable = getattr(request, "prompt_embeds", None) is None
            chains = [KeyChain(seed, self.bs) for seed in self.seeds(salt, lora, mm)]
            st = RequestState(request=request, chains=chains, cacheable=cacheable)
            self._reqs[rid] = st
        return st

    def _release(self, lease: Optional[Lease],
                 discard: Optional[Dict[int, Sequence[int]]] = None, loaded: int = 0) -> None:
        """Release every rank's lease; discard[rank]: lease positions to drop;
        with the lookup's report, `loaded` blocks (from lease.start) count as hits."""
        if lease is None:
            return
        report = None if lease.report is None else {**lease.report, "loaded_blocks": loaded}
        for rank, lid in enumerate(lease.ids):
            self.releasers[rank].release(lid, discard_indices=(discard or {}).get(rank, ()),
                                         report=report, last_turn=lease.last_turn)

    def _drop_lease(self, st: RequestState) -> None:
        lease, st.lease = st.lease, None
        self._release(lease)

    # ---- lookups

    def _may_load(self, st: RequestState) -> bool:
        return bool(self.cfg.load and st.cacheable and not self.loads_disabled
                    and not getattr(st.request, "skip_reading_prefix_cache", False))

    def _start_lookup(self, st: RequestState) -> bool:
        """Submit Match(lease) of the request's full blocks from block 0 on every
        rank; False when there is nothing a hit could cover."""
        limit = matchable_blocks(st.request.num_tokens, self.bs)
        if hit_tokens(st.request.num_tokens, limit, self.bs) <= 0:
            return False
        futures = []
        for rank, link in enumerate(self.links):
            keys = list(st.keys(rank, 0, limit))
            futures.append(link.submit(lambda c, keys=keys: match_with_refs(c, keys, self._peer),
                                       "lookup"))
        st.lookup = Lookup(futures, limit, self._clock() + self.cfg.lookup_timeout_s, st.last_turn)
        return True

    def _forget_lookup(self, st: RequestState) -> None:
        """Nobody will use st's lookup: release its leases whenever it lands."""
        lk, st.lookup = st.lookup, None
        if lk is not None:
            lk.release_when_done(self.releasers)

    def _wait_for(self, lk: Lookup) -> None:
        left = lk.deadline - self._clock()
        if self._answered or self.cfg.lookup_wait_s <= 0:
            budget = min(self._wait_left, left)
        else:
            # Nothing runs this step unless this answer comes: skipping the
            # request would only give an empty step (a round trip to the
            # workers) and a wait of lookup_wait_s on the next, each time
            # (issue 12: 31 of 49 lookups of a loaded machine's bench were
            # "pending", each an extra step of 5-6 ms, up to 23 in a row).
            # Wait for the answer, up to IDLE_WAIT_S: requests that arrive
            # meanwhile are taken at most that much later.
            budget = min(max(self._wait_left, IDLE_WAIT_S), left)
        if budget < 1e-6:
            return
        t = self._clock()
        self._wait(lk.futures, budget)
        self._wait_left -= max(0.0, self._clock() - t)

    def _answer(self, st: RequestState, lk: Lookup, num_computed_tokens: int) -> Tuple[int, bool]:
        request = st.request
        ans = lk.answer()
        lease, error, matched = ans.lease, ans.error, ans.matched
        if error is not None:
            self._release(lease)
            self.counters.inc("lookup_errors")
            if not isinstance(error, LinkDown):
                log.debug("kvkeeper: lookup of %s failed: %s", request.request_id, error)
            return 0, False
        if ans.peer is not None and ans.peer.matched > matched:   # a same-host peer holds more
            self._release(lease)   # load it all from there, without a daemon lease
            lease, matched = peer_lease(len(lease.ids), ans.peer), ans.peer.matched
        bs = self.bs
        top = hit_tokens(request.num_tokens, lk.limit, bs)
        self.counters.inc("lookups")
        self.counters.inc("lookup_tokens", max(0, top - num_computed_tokens))
        local = min(num_computed_tokens // bs, lk.limit)
        lease.report = use_report(request.num_tokens, lk.limit, local)
        hit = hit_tokens(request.num_tokens, matched, bs) - num_computed_tokens
        if hit <= 0 or not self._may_load(st):
            self._release(lease)
            return 0, False
        lease.start = local
        lease.blocks = matched - lease.start
        lease.computed = num_computed_tokens
        lease.narrow(local, ans.per_rank, matched, self.releasers)
        st.lease = lease
        return hit, self.async_loads

    # ---- vLLM hooks

    def on_new_request(self, request: Any) -> None:
        st = self._state(request)
        # Ask the daemon now: the answer is likely there when vLLM schedules it.
        if st.lookup is None and st.lease is None and self._may_load(st):
            self._start_lookup(st)

    def get_num_new_matched_tokens(self, request: Any,
                                   num_computed_tokens: int) -> Tuple[Optional[int], bool]:
        st = self._state(request)
        lk = st.lookup
        if lk is None:
            # Not looked up yet, or asked again after the answer was used (not
            # scheduled last time, or resumed after preemption): the earlier
            # lease and save progress are stale.
            self._drop_lease(st)
            st.saved_blocks = None
            if not self._may_load(st) or not self._start_lookup(st):
                self._answered.add(request.request_id)
                return 0, False
            lk = st.lookup
            assert lk is not None
        if not lk.done() and num_computed_tokens >= hit_tokens(request.num_tokens, lk.limit, self.bs):
            # vLLM's own cache holds all that a hit could cover: the answer is
            # 0 whatever the daemon says, so do not wait for it (~1 ms a request).
            st.lookup = None
            self._answered.add(request.request_id)
            self.counters.inc("lookups")
            lk.release_when_done(self.releasers, use_report(
                request.num_tokens, lk.limit, num_computed_tokens // self.bs), lk.last_turn)
            return 0, False
        if not lk.done():
            self._wait_for(lk)
            if not lk.done():
                if self._clock() < lk.deadline:
                    return None, False   # pending: vLLM asks again next step
                self._forget_lookup(st)
                self.counters.inc("lookup_errors")
                log.debug("kvkeeper: lookup of %s not answered within %.3f s; a miss",
                          request.request_id, self.cfg.lookup_timeout_s)
                self._answered.add(request.request_id)
                return 0, False
        st.lookup = None
        self._answered.add(request.request_id)
        return self._answer(st, lk, num_computed_tokens)

    def update_state_after_alloc(self, request: Any, blocks: Any, num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        lease = st.lease
        if num_external_tokens <= 0 or lease is None:
            self._drop_lease(st)
            return
        st.lease = None
        # Every block the hit touches is loaded whole: a hit ends one token
        # short of a block boundary when it covers all but the prompt's last
        # token (vLLM computes that token and writes its KV over the loaded one).
        end = lease.computed + num_external_tokens
        n = -(-end // self.bs) - lease.start
        group_ids: Tuple[Tuple[int, ...], ...] = ()
        try:
            all_ids = blocks.get_block_ids()
            block_ids = list(all_ids[0])
            n = lease.blocks = min(n, lease.blocks)
            targets = tuple(block_ids[lease.start:lease.start + n])
            if self.async_loads:
                group_ids = tuple(tuple(list(g)[lease.start:lease.start + n]) for g in all_ids)
                if len(group_ids) != self.groups or any(len(g) != n for g in group_ids):
                    raise ValueError(f"{len(all_ids)} KV cache groups' block ids, not "
                                     f"{self.groups} of [{lease.start}, {lease.start + n})")
            if len(targets) != n:
                raise ValueError(f"request has {len(block_ids)} blocks, the load needs "
                                 f"[{lease.start}, {lease.start + n})")
            keys = tuple(st.keys(r, lease.start, lease.start + n)
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
        refs: Tuple[Tuple[Any, ...], ...] = ()
        if len(lease.refs) == len(self.links) and \
                all(len(r) >= lease.start + n for r in lease.refs):
            refs = tuple(tuple(stored(r[lease.start:lease.start + n])) for r in lease.refs)
        load = LoadSpec(req_id=request.request_id, keys=keys, block_ids=targets,
                        load_id=self._next_load_id, refs=refs, arena_ids=tuple(lease.arenas),
                        group_block_ids=group_ids, peer=lease.peer_part(n),
                        recomputes_last=end % self.bs != 0 and n == -(-end // self.bs) - lease.start)
        self._next_load_id += 1
        self._pending_loads.append((request.request_id, load, lease))
        # The loaded blocks are in the daemon: not saved again (a failed load
        # lowers this in update_connector_output).
        st.saved_blocks = max(st.saved_blocks or 0, lease.start + n)
        tokens = max(0, min(num_external_tokens, (lease.start + n) * self.bs - lease.computed))
        st.hit_tokens += tokens
        self.counters.inc("hit_tokens", tokens)
        st.hit_sources = lease_sources(lease, num_external_tokens, self.bs)

    def build_connector_meta(self, scheduler_output: Any,
                             block_ids_of: Callable[[str], Optional[Sequence[int]]]
                             ) -> KVKeeperConnectorMetadata:
        meta = KVKeeperConnectorMetadata()
        # Loads first and unconditionally: vLLM already counts them as computed.
        for req_id, load, lease in self._pending_loads:
            meta.loads.append(load)
            self._inflight[load.load_id] = (req_id, lease)
            self.gates.planned(load)
            st = self._reqs.get(req_id)
            if st is not None:
                st.loads.add(load.load_id)
        self._pending_loads = []
        meta.load_outcomes = self.gates.take()
        self._wait_left = self.cfg.lookup_wait_s   # the next step's
        if self.cfg.save:
            try:
                plan_saves(scheduler_output, self._reqs, len(self.links), self.bs,
                           block_ids_of, meta)
            except Exception as e:  # a missed save is a future miss, nothing worse
                log.warning("kvkeeper: planning this step's saves failed: %s", e, exc_info=True)
        return meta

    def update_connector_output(self, connector_output: Any) -> None:
        wm = getattr(connector_output, "kv_connector_worker_meta", None)
        if not isinstance(wm, KVKeeperWorkerMetadata):
            return
        if wm.disabled and not self.loads_disabled:
            self.loads_disabled = "; ".join(sorted(set(wm.disabled.values())))
            log.error("kvkeeper: a worker cannot load blocks (%s); lookups are off for this "
                      "engine, saves too", self.loads_disabled)
            self.cfg = replace(self.cfg, load=False, save=False)
        self.gates.reported(wm.loads_done)
        for load_id, ranks in wm.loads_done.items():
            if (entry := self._inflight.pop(load_id, None)) is None:
                continue
            req_id, lease = entry
            st = self._reqs.get(req_id)
            good = min((g for g, _ in ranks.values()), default=0)
            # The lease's position 0 is request block lease.base.
            corrupt = {r: [lease.start - lease.base + i for i in bad]
                       for r, (_, bad) in ranks.items() if bad}
            if st is not None:
                st.loads.discard(load_id)
                if st.saved_blocks is not None and good < lease.blocks:
                    # vLLM recomputes from the first block that failed; the
                    # corrupt ones are dropped below and saved again then.
                    st.saved_blocks = min(st.saved_blocks, lease.start + good)
            # vLLM recomputes from the first block that failed on any rank (a
            # peer's blocks are no hit of the daemon's).
            self._release(lease, corrupt, loaded=0 if lease.peer else min(good, lease.blocks))
            if corrupt:
                # Rare: the discard should reach the daemon before the blocks are
                # saved again (else they find the corrupt one present and skip it).
                # Briefly: this is vLLM's scheduler loop; a late one costs a save.
                until = time.monotonic() + min(IDLE_WAIT_S, self.cfg.lookup_timeout_s)
                for r in corrupt:
                    self.releasers[r].flush(max(0.0, until - time.monotonic()))

    def request_finished(self, request: Any) -> Optional[Dict[str, Any]]:
        """Release what the request still holds; the report for kv_transfer_params."""
        st = self._reqs.pop(request.request_id, None)
        self._answered.discard(request.request_id)
        if st is None:
            return None
        self._forget_lookup(st)
        self._drop_lease(st)
        self.gates.hold(request.request_id, st.loads)   # its saves may wait for them
        for load_id in st.loads:
            entry = self._inflight.pop(load_id, None)
            if entry is not None:
                self._release(entry[1])
        if not self.cfg.report:
            return None
        return {"kvkeeper": st.report(self.bs, self.namespaces, self.groups)}

    def hit_sources(self, request: Any) -> Dict[str, int]:   # the last hit's, split by tier
        return dict(getattr(self._reqs.get(request.request_id), "hit_sources", None) or {})

    def take_stats(self) -> Optional[KVKeeperStats]:
        return self.counters.take()

    def held_leases(self) -> int:
        """Leases taken and not yet handed to a releaser (for tests and logs)."""
        n = sum(1 for st in self._reqs.values() if st.lease is not None)
        return n + len(self._inflight) + len(self._pending_loads)

    def pending_lookups(self) -> int:
        """Lookups in flight whose answer vLLM has not had yet."""
        return sum(1 for st in self._reqs.values() if st.lookup is not None)

    def shutdown(self) -> None:
        # Never waits for a lookup in flight: closing the links fails the
        # queued ones, and the daemon frees a closed session's leases.
        for st in self._reqs.values():
            self._forget_lookup(st)
            self._drop_lease(st)
        for _, lease in self._inflight.values():
            self._release(lease)
        self._inflight.clear()
        for r in self.releasers:
            r.close(timeout=0.5)   # closing the session frees whatever is left
        for link in self.links:
            link.close()

