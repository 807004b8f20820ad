"""The tier stack: the host arena on top, the tiers below it, and every movement
of blocks between them.

The ledger keeps every tier's book (pure, no I/O); each tier holds bytes
behind the one contract of backend.py; the stack is the asyncio layer that
moves blocks and tells the ledger what moved. What it owns:

* Match across tiers in order: the ledger says which tier holds each leading
  key (Ledger.locate); a key in no book may still be in a medium another
  daemon writes too, so the stack probes the tiers below for it, a run of
  keys at a time (LowerTier.probe_run). A tier whose medium decides what it
  keeps (keeps_book False: the cluster) keeps no book at rest: it books a
  found copy for the lookup that moves it and forgets it after, so every
  lookup asks the medium again.
* Promotion of a leased hit: a lower tier's block is copied into freshly
  reserved arena pages (held by the ledger's internal holder) and committed
  before the caller's lease is taken, so Load and LoadStream only ever read
  the arena. Concurrent promotions of one block share one copy.
* Flushing down (flush.py): write-through (CommitSave answers once the
  blocks are below), write-back (flushed in the background; each block
  stays pinned by an internal lease from its commit until its flush ends, so
  the arena evicts only blocks that are below already), admission after N
  hits (a block goes down once hit admit_after_hits times), and demotion:
  the arena's victims of capacity pressure that a lower tier holds leave as
  "demoted", not lost.

Nothing above the stack (servicer, admin, metrics, watch, app) knows which
tiers exist: adding a tier is one module offering LowerTier, its config,
and the contract suite (tests/server/tiers/test_backend_contract.py).
"""
from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional, Protocol, Sequence

from ..errors import ClientError, ResourceExhausted
from ..ids import LOCAL, Identity, NamespaceId, SessionId, TierName
from ..ledger import (Block, BlockState, Copy, Holding, Ledger, MatchResult, Namespace,
                      TierStats)
from ..ledger.disk_index import DiskEntry, DiskIndex
from ..ledger.views import copies, holdings, tier_stats
from ..ops.ratelog import RepeatLog
from .arena import Arena
from .backend import ArenaBackend, BlockStore, Checksum, CorruptBlock, TierError
from .flush import Flusher

log = logging.getLogger("kvkeeper.stack")


@dataclass(frozen=True)
class TierCounter:
    """One series a tier exports beside its book (kvkeeper_<name>[_total])."""

    name: str
    kind: str       # "counter" or "gauge"
    help: str
    value: float
    # (label, value) pairs: the series of one name share help, kind and label names.
    labels: tuple[tuple[str, str], ...] = ()


class LowerTier(Protocol):
    """A tier below the arena, as the stack drives it (disk_tier.DiskTier and
    cluster.tier.ClusterTier are two)."""

    name: TierName
    write_back: bool          # flush after CommitSave answers, not before
    admit_after_hits: int     # 0: every committed block goes down; N: once hit N times
    flush_failures: int
    # True: the tier's book is its index of what the medium holds (the disk).
    # False: the medium decides what it keeps (a cluster's maxmemory); the book
    # holds only the copies being moved, and every lookup probes the medium.
    keeps_book: bool

    def loc(self, ns: bytes, key: bytes, nbytes: int) -> Any: ...
    async def probe_run(self, ns: bytes, keys: Sequence[bytes]) -> list[Optional[int]]:
        """What the medium holds of the first keys, though no book says so
        (another daemon wrote them): for as many keys as the tier asks about in
        one go, the payload size or None (not there). A fault answers [];
        only the leading run counts."""
        ...
    async def read_block(self, loc: Any, dst: BlockStore[Any], dst_loc: Any) -> Optional[Checksum]:
        """Copy a stored block into another tier; the checksum its writer
        committed, kept with it (None if none). TierError: unreadable (a miss)."""
        ...
    async def write_block(self, src: BlockStore[Any], src_loc: Any, loc: Any,
                          checksum: Optional[Checksum] = None) -> None:
        """Store a block copied from another tier with its writer's checksum; TierError."""
        ...
    def refusal(self, e: TierError) -> Optional[ClientError]:
        """What a write-through save answers when its block could not be stored;
        None: the save stands (a tier that drops what it cannot store)."""
        ...
    async def forget(self, where: tuple[bytes, bytes]) -> None: ...
    async def maintain(self) -> None: ...
    async def close(self) -> None: ...
    def counters(self) -> list[TierCounter]: ...
    def errors(self) -> dict[str, int]: ...


class TierStack:
    def __init__(self, ledger: Ledger, arena: Arena, lower: Sequence[LowerTier] = (),
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        top = ledger.top
        self.host = ArenaBackend(arena, lambda: top.used_pages * top.page_bytes)
        self.lower = list(lower)
        self._by_name = {t.name: t for t in self.lower}
        self.clock = clock
        self.flusher = Flusher(ledger, self.host, self._host_loc, clock)
        self._promotions: dict[tuple[bytes, bytes], asyncio.Task[bool]] = {}
        self._promoting: dict[tuple[bytes, bytes], TierName] = {}   # from which tier
        # A tier failing keeps failing for a while: its lines repeat at a bounded rate.
        self._unreadable = RepeatLog(log, "tier_block_unreadable")

    def tier(self, name: TierName) -> Optional[LowerTier]:
        return self._by_name.get(name)

    # ------------------------------------------------------------ reading the books
    def tier_stats(self) -> list[TierStats]:
        return tier_stats(self.ledger)

    def holdings(self) -> dict[NamespaceId, list[Holding]]:
        return holdings(self.ledger)

    def copies(self, ns_id: NamespaceId, key: bytes) -> list[Copy]:
        return copies(self.ledger, ns_id, key, self.clock())

    def counters(self) -> list[TierCounter]:
        """The series the lower tiers export beside their books."""
        return [c for t in self.lower for c in t.counters()]

    def errors(self) -> dict[TierName, dict[str, int]]:
        return {t.name: t.errors() for t in self.lower}

    def verifiable(self) -> Optional[Any]:
        """The first tier that can re-check its stored blocks (verify_all), or None."""
        return next((t for t in self.lower if hasattr(t, "verify_all")), None)

    # ------------------------------------------------------------ match
    async def match(self, sid: SessionId, keys: Sequence[bytes], *, lease: bool,
                    report_use: bool = False, owner: Identity = LOCAL) -> MatchResult:
        L = self.ledger
        if not self.lower:
            return L.match(sid, keys, lease=lease, now=self.clock(), report_use=report_use,
                           owner=owner)
        session = L.session(sid, self.clock(), owner)
        keys = L.check_keys(keys, unique=False)
        ns = session.ns
        held: list[tuple[DiskIndex, DiskEntry]] = []
        try:
            where = await self._locate(ns, keys, held)
            return await self._match_located(sid, ns, keys, where, lease=lease,
                                             report_use=report_use, owner=owner)
        finally:
            self._let_go(held)

    async def _match_located(self, sid: SessionId, ns: Namespace, keys: list[bytes],
                             where: list[TierName], *, lease: bool, report_use: bool,
                             owner: Identity) -> MatchResult:
        L = self.ledger
        n = len(where)
        below = {i: t for i, t in enumerate(where) if t in self._by_name}
        if below and lease:
            # Each promotion reserves before its first await, in key order, so a
            # block's parent (the key before it) is in the arena by then: it is
            # filed under it, as a save naming its parent is.
            promoted = await asyncio.gather(*(
                self._promote(ns, keys[i], self._by_name[t], keys[i - 1] if i else None)
                for i, t in below.items()))
            # The chain ends at the first block that could not be brought up.
            for i, ok in zip(below, promoted):
                if not ok:
                    n = i
                    break
            below = {i: t for i, t in below.items() if i < n}
        else:
            for i, t in below.items():
                L.touch(t, ns, keys[i])
        if not lease:
            top_keys = [k for i, k in enumerate(keys[:n]) if i not in below]
            L.match(sid, top_keys, lease=False, now=self.clock(), report_use=report_use,
                    owner=owner)
            # The request looked up every key, not only those the arena holds.
            L.count_asked(ns, len(keys) - len(top_keys), report_use)
            return MatchResult(n, [below.get(i, L.top.name) for i in range(n)], None)
        r = L.match(sid, keys[:n], lease=True, now=self.clock(), below=below,
                    report_use=report_use, owner=owner)
        L.count_asked(ns, len(keys) - n, report_use)
        self._admit(ns, keys[:r.matched])
        return MatchResult(r.matched, [below.get(i, t) for i, t in enumerate(r.tiers)],
                           r.lease_id)

    async def _locate(self, ns: Namespace, keys: list[bytes],
                      held: list[tuple[DiskIndex, DiskEntry]]) -> list[TierName]:
        """The tier of each leading key, probing the media below for keys no
        book holds (another daemon may have written them). The copies found in
        tiers that keep no book are pinned into `held` as soon as found, so
        that no concurrent lookup's _let_go forgets them meanwhile."""
        where: list[TierName] = []
        while True:
            found = self.ledger.locate(ns, keys, len(where))
            self._hold(ns, keys, len(where), found.tiers, held)
            where += found.tiers
            if len(where) == len(keys):
                return where
            if not found.probe:
                # Being written into the arena: by a promotion, this lookup shares it.
                promoting = self._promoting.get((ns.id, keys[len(where)]))
                if promoting is None:
                    return where
                where.append(promoting)
                continue
            run, more = await self._probe(ns, keys, len(where))
            self._hold(ns, keys, len(where), run, held)
            where += run
            if not more:
                return where

    async def _probe(self, ns: Namespace, keys: list[bytes],
                     start: int) -> tuple[list[TierName], bool]:
        """The tier of the leading keys from `start` on that some medium below
        holds, from the first tier that has the first of them, adopted into its
        book (no await after the probe's answer), and whether the lookup goes
        on: False once a key is missing or unusable. The run also stops at a
        key the ledger knows of (the arena, a book): located there."""
        L, deletes = self.ledger, self.flusher.deletes
        for t in self.lower:
            since = deletes.probe_started()
            try:
                sizes = await t.probe_run(ns.id, keys[start:])
                run: list[TierName] = []
                for k, nbytes in zip(keys[start:], sizes):
                    if run and not L.locate(ns, [k]).probe:
                        return run, True
                    # A copy our own eviction is deleting, or deleted while the
                    # probe was out, is not adopted: the book would list a gone file.
                    if (nbytes is None or deletes.stale(t.name, (ns.id, k), since)
                            or not L.adopt(t.name, ns, k, nbytes)):
                        break
                    run.append(t.name)
            finally:
                deletes.probe_ended(since)
            if run:
                # All it asked about were there: the chain may go on past them.
                return run, len(run) == len(sizes)
        return [], False

    def _hold(self, ns: Namespace, keys: list[bytes], start: int, tiers: list[TierName],
              held: list[tuple[DiskIndex, DiskEntry]]) -> None:
        """Pin the copies a lookup found in tiers that keep no book."""
        for k, t in zip(keys[start:], tiers):
            tier = self._by_name.get(t)
            if tier is None or tier.keeps_book:
                continue
            book = self.ledger.lower[t]
            entry = book.get(ns.id, k)
            if entry is not None:
                book.pin(entry)
                held.append((book, entry))

    @staticmethod
    def _let_go(held: list[tuple[DiskIndex, DiskEntry]]) -> None:
        """After a lookup: unpin what _hold pinned; a copy nobody else pins is
        forgotten (promoted, touched or cut off: the medium keeps it or not)."""
        for book, entry in held:
            book.unpin(entry)
            if entry.pins == 0:
                book.forget(entry)

    # ------------------------------------------------------------ promotion
    async def _promote(self, ns: Namespace, key: bytes, tier: LowerTier,
                       parent: Optional[bytes] = None) -> bool:
        """Copy a lower tier's block into the arena; True once committed there.
        `parent`: the key before it in its chain (None: unknown)."""
        where = (ns.id, key)
        task = self._promotions.get(where)
        if task is None:
            # Its own task, shared by every lookup of the block: a lookup whose
            # caller gave up (grpc cancels its handler) leaves the copy going,
            # so the others get the block and the copy cleans up after itself.
            task = asyncio.get_running_loop().create_task(self._promotion(ns, key, tier, parent))
            self._promotions[where] = task
            self._promoting[where] = tier.name
        return await asyncio.shield(task)

    async def _promotion(self, ns: Namespace, key: bytes, tier: LowerTier,
                         parent: Optional[bytes]) -> bool:
        try:
            return await self._copy_up(ns, key, tier, parent)
        except Exception:  # noqa: BLE001 - a failed promotion is a miss, never an error
            log.exception("promotion of a %s block failed", tier.name)
            return False
        finally:
            del self._promotions[(ns.id, key)], self._promoting[(ns.id, key)]

    async def _copy_up(self, ns: Namespace, key: bytes, tier: LowerTier,
                       parent: Optional[bytes]) -> bool:
        L = self.ledger
        book = L.lower[tier.name]
        entry = book.get(ns.id, key)
        if entry is None:   # gone, or promoted by a lookup that just ended
            now = L.block(ns.id, key)
            return now is not None and now.state is BlockState.COMMITTED
        try:
            r = L.reserve_internal(ns.id, [key], self.clock(), parent)
        except ResourceExhausted:
            return False  # the arena is pinned full: serve what the host has
        b = r.blocks[0]
        if b is None:  # it reached the arena meanwhile
            now = L.block(ns.id, key)
            return now is not None and now.state is BlockState.COMMITTED
        assert r.reservation_id is not None
        book.pin(entry)
        try:
            kept = await tier.read_block(tier.loc(ns.id, key, ns.block_bytes), self.host,
                                         self._host_loc(b))
        except TierError as e:
            self._unreadable.log("%s block unreadable, treated as a miss: %s", tier.name, e)
            book.unpin(entry)
            book.drop(entry, "corrupt" if isinstance(e, CorruptBlock) else "lost")
            L.abort_internal(r.reservation_id, self.clock())
            return False
        except Exception:
            # A bug, not the medium: the read has ended (its error came back),
            # so the pages can go; the copy stays in the book.
            book.unpin(entry)
            L.abort_internal(r.reservation_id, self.clock())
            raise
        book.unpin(entry)
        book.touch(entry)
        # The lower tier kept its writer's checksum: readers check the block again.
        L.commit_internal(r.reservation_id, self.clock(), kept)
        return True

    def _host_loc(self, b: Block) -> Any:
        return self.host.locate(b.ns.id, b.key, b.ns.block_bytes, b.pages)

    # ------------------------------------------------------------ flushing down (flush.py)
    def _admit(self, ns: Namespace, keys: Sequence[bytes]) -> None:
        self.flusher.admit(self.lower, ns, keys)

    async def committed(self, ns: Namespace, keys: Sequence[bytes]) -> None:
        """Called after a client's commit. Write-through: returns once below."""
        await self.flusher.committed(self.lower, ns, keys)

    # ------------------------------------------------------------ lifetime
    async def maintain(self) -> None:
        """Periodic upkeep of every tier (the reaper calls it about once a second)."""
        for t in self.lower:
            await t.maintain()

    async def drain(self) -> None:
        """Finish every flush and promotion (graceful shutdown, admin Drain)."""
        while self.flusher.tasks or self._promotions:
            await self.flusher.drain()
            await asyncio.gather(*list(self._promotions.values()), return_exceptions=True)

    async def close(self) -> None:
        await self.drain()
        for t in self.lower:
            await t.close()
