"""A lookup in flight: each TP rank's leased Match of a request's full
blocks, submitted on that rank's link thread so the scheduler thread never
waits for the daemon, and its answer read back into a Lease: what the
request holds in the daemon until its load is reported or it finishes."""
from __future__ import annotations

import concurrent.futures
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence, Tuple

__all__ = ["Lease", "Lookup", "LookupAnswer", "match_with_refs", "peer_lease", "use_report",
           "wait_all"]


def match_with_refs(client: Any, keys: List[bytes],
                    peer: Optional[Callable[[Any, List[bytes], int], Any]] = None
                    ) -> Tuple[Any, Optional[bytes], Any]:
    """Leased Match that also returns where the blocks lie in shared memory
    (for the worker, which then needs no RPC of its own), and which arena;
    and, with `peer` (peer(client, keys, blocks matched), asked only when
    the daemon holds fewer than all keys), a same-host peer's longer hit
    (kvkeeper.connector.peer), or None."""
    res = client.match(keys, lease=True, blocks=True, report_use=True)
    short = peer is not None and res.matched < len(keys)
    hit = peer(client, keys, res.matched) if short else None
    return res, getattr(client, "arena_id", None), hit


def wait_all(futures: Sequence[Future[Any]], timeout: float) -> None:
    concurrent.futures.wait(futures, timeout=timeout)


@dataclass
class Lease:
    ids: List[Optional[int]]   # per TP rank; None where that rank matched nothing
    start: int                 # first block (index in the request) to load; the
    #                            lease itself covers blocks from 0 on
    blocks: int                # blocks from `start` on matched on every rank
    computed: int = 0          # tokens vLLM had already (the hit is counted after them)
    tiers: List[int] = field(default_factory=list)   # rank 0: each block's tier, from block 0
    base: int = 0              # request block at the daemon leases' position 0 (once narrowed)
    report: Optional[Dict[str, int]] = None   # the LookupReport, less loaded_blocks
    refs: List[Sequence[Any]] = field(default_factory=list)   # per rank: BlockRefs from block 0
    arenas: List[Optional[bytes]] = field(default_factory=list)   # per rank: the refs' arena
    # Loaded from a same-host peer's cache instead (no daemon lease): its
    # segment and (block, generation) of each block from block 0.
    peer: Optional[Tuple[str, Tuple[Tuple[int, int], ...]]] = None
    # The request said it is its conversation's last turn (sched_state.last_turn):
    # released whole, with Release.last_turn.
    last_turn: bool = False

    def narrow(self, local: int, per_rank: Sequence[int], matched: int,
               releasers: Sequence[Any]) -> None:
        """Unpin, through each rank's releaser, what vLLM holds itself (the
        first `local` blocks) and what another rank lacks: the lease keeps
        blocks [local, local + self.blocks). A last turn keeps it all until its
        release, which demotes what it read, vLLM's own hit included."""
        if self.last_turn:
            return
        for rank, lid in enumerate(self.ids):
            if local or per_rank[rank] > matched:
                releasers[rank].narrow(lid, local, self.blocks)
        if local:
            self.base = local

    def peer_part(self, n: int) -> Optional[Tuple[str, Tuple[Tuple[int, int], ...]]]:
        """The peer's segment and its blocks of the n blocks loaded from `start`."""
        if self.peer is None:
            return None
        return self.peer[0], tuple(self.peer[1][self.start:self.start + n])


def peer_lease(ranks: int, hit: Any) -> Lease:
    """The lease of a load from a same-host peer (hit: client.peer.PeerMatch)."""
    # TIER_GPU (1) for every block: vLLM's hit sources count them as p2p.
    return Lease([None] * ranks, 0, 0, peer=(hit.segment, tuple(hit.blocks)),
                 tiers=[1] * len(hit.blocks))


def use_report(prompt_tokens: int, limit: int, local_blocks: int) -> Dict[str, int]:
    """What a lookup's Release reports (ReleaseRequest's report): the prompt,
    the blocks looked up and those vLLM's own cache held (loaded_blocks is
    the releaser's caller's to add)."""
    return {"prompt_tokens": prompt_tokens, "prompt_blocks": limit,
            "local_blocks": min(local_blocks, limit)}


def _release_landed(releaser: Any, fut: Future[Any], report: Optional[Mapping[str, int]],
                    last_turn: bool) -> None:
    if fut.cancelled() or fut.exception() is not None:
        return   # nothing was leased
    releaser.release(getattr(fut.result()[0], "lease_id", None),
                     report=None if report is None else {**report, "loaded_blocks": 0},
                     last_turn=last_turn)


@dataclass
class LookupAnswer:
    lease: Lease                   # every rank's lease (start and blocks still 0)
    per_rank: List[int]            # blocks each rank matched
    matched: int                   # blocks matched on every rank
    error: Optional[BaseException] = None   # a rank's lookup failed: a miss
    peer: Any = None               # a same-host peer's longer hit (client.peer.PeerMatch)


@dataclass
class Lookup:
    futures: List[Future[Any]]   # per TP rank: match_with_refs of keys[0:limit]
    limit: int                     # blocks looked up, from block 0
    deadline: float                # a miss if not answered by then
    last_turn: bool = False        # the request's (sched_state.last_turn), for its lease

    def done(self) -> bool:
        return all(f.done() for f in self.futures)

    def release_when_done(self, releasers: Sequence[Any],
                          report: Optional[Mapping[str, int]] = None,
                          last_turn: bool = False) -> None:
        """Nobody will use this lookup: release each rank's lease (with
        `report` and `last_turn`, as Releaser.release) whenever its Match
        lands, on the link's thread (or here, if it already has)."""
        for rank, fut in enumerate(self.futures):
            fut.add_done_callback(lambda f, r=releasers[rank]: _release_landed(r, f, report,
                                                                              last_turn))

    def answer(self) -> LookupAnswer:
        """The ranks' results, once done(); the leases taken are in the answer
        even when another rank failed, for the caller to release."""
        ids: List[Optional[int]] = []
        matched = self.limit
        error: Optional[BaseException] = None
        refs: List[Sequence[Any]] = []
        arenas: List[Optional[bytes]] = []
        per_rank: List[int] = []
        tiers: List[int] = []
        peers: List[Any] = []
        for fut in self.futures:
            try:
                res, arena, *more = fut.result()
            except Exception as e:
                error = error or e
                ids.append(None)
                continue
            ids.append(res.lease_id)
            refs.append(res.blocks)
            arenas.append(arena)
            per_rank.append(res.matched)
            peers.append(more[0] if more else None)
            matched = min(matched, res.matched)
            if not tiers:
                tiers = list(getattr(res, "tiers", None) or ())
        return LookupAnswer(Lease(ids, 0, 0, refs=refs, arenas=arenas, tiers=tiers,
                                  last_turn=self.last_turn), per_rank,
                            matched, error, peers[0] if len(self.futures) == 1 and peers else None)
