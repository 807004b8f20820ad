"""The block ledger: a pure, synchronous state machine (no asyncio, no grpc, no I/O).

Callers pass the time in (`now`, seconds on a monotonic clock), so tests drive
expiry without sleeping and the gRPC servicer stays a thin adapter.
Every public method either completes or raises a ClientError having changed
nothing; `check_invariants()` states what must hold between calls.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Collection, Iterable, Mapping, Optional, Sequence

from ..errors import (FailedPrecondition, InvalidArgument, InvariantViolation, NotFound,
                      OutOfRange, ResourceExhausted)
from ..quoting import clip
from ..ids import LOCAL, BlockKey, Identity, LeaseId, NamespaceId, ReservationId, SessionId, TierName
from .pages import iter_pages
from .quota import check_quota, quota_for
from .records import Block, Lease, Namespace, NamespaceDescriptor, Reservation, Session
from .sessions import SessionTable
from .states import BlockState, Event, next_state
from .tier import Tier, TierSpec
from .units import pages_for_bytes
from .usage import LookupReport, Usage

S, E = BlockState, Event


@dataclass(frozen=True)
class LedgerConfig:
    tiers: Sequence[TierSpec]
    policy: str = "lru"
    key_bytes: int = 32
    max_keys_per_call: int = 4096
    lease_ttl_s: float = 30.0
    reservation_timeout_s: float = 60.0


@dataclass(frozen=True)
class MatchResult:
    matched: int
    tiers: list[TierName]
    lease_id: Optional[LeaseId]


class SlotStatus:
    RESERVED = "reserved"
    PRESENT = "present"
    IN_FLIGHT = "in-flight"


@dataclass(frozen=True)
class ReserveResult:
    reservation_id: Optional[ReservationId]
    statuses: list[str]
    blocks: list[Optional[Block]]      # the reserved block per key, None when skipped
    expires_at: float


@dataclass
class ExpiryReport:
    sessions: list[SessionId] = field(default_factory=list)
    reservations: list[ReservationId] = field(default_factory=list)


class Ledger:
    def __init__(self, config: LedgerConfig, quotas: Optional[Mapping[str, int]] = None) -> None:
        if not config.tiers:
            raise ValueError("the ledger needs at least one tier")
        self.config = config
        # Model id (or "*") -> host-tier bytes per namespace (see quota.py). Not part of
        # the frozen config: a reload replaces it while sessions go on.
        self.quotas: dict[str, int] = dict(quotas or {})
        self.tiers: dict[TierName, Tier] = {t.name: Tier(t, config.policy) for t in config.tiers}
        # New blocks land in the first tier; lower tiers come with later issues.
        self.top: Tier = self.tiers[config.tiers[0].name]
        self.namespaces: dict[NamespaceId, Namespace] = {}
        self._sessions = SessionTable()
        # The live sessions by id (read by metrics, admin and tests; changed only here).
        self.sessions: dict[SessionId, Session] = self._sessions.live
        self.leases: dict[LeaseId, Lease] = {}
        self.reservations: dict[ReservationId, Reservation] = {}
        self._next_lease = 1
        self._next_reservation = 1
        # Monotonic counters, read by the metrics collector.
        self.lookups = 0
        self.lookup_keys = 0
        self.usage = Usage()
        self.sessions_expired = 0
        self.reservations_timed_out = 0

    # ------------------------------------------------------------ sessions
    def register_session(self, instance_id: str, descriptor: NamespaceDescriptor,
                         now: float, *, owner: Identity = LOCAL) -> Session:
        if len(instance_id.encode()) > 256:
            raise InvalidArgument("instance_id is longer than 256 bytes")
        descriptor.validate()
        ns = self.namespaces.get(descriptor.digest())
        if ns is None:
            ppb = pages_for_bytes(descriptor.block_bytes, self.top.page_bytes)
            if ppb > self.top.capacity_pages:
                raise InvalidArgument(
                    f"a block of {descriptor.block_bytes} B does not fit in the {self.top.name} tier "
                    f"({self.top.capacity_pages * self.top.page_bytes} B); raise its capacity")
            ns = Namespace(descriptor, ppb)
            self.namespaces[ns.id] = ns
        session = Session(self._sessions.new_id(), instance_id, ns,
                          now + self.config.lease_ttl_s, owner)
        ns.sessions += 1
        self._sessions.add(session)
        return session

    def session(self, sid: SessionId, now: float, owner: Identity = LOCAL) -> Session:
        """The live session `sid` of `owner`. Looking it up does not renew it:
        only a call that succeeds does (renew), so failing calls are no heartbeat."""
        session = self._sessions.resolve(sid, owner)
        if session.expires_at < now:
            self._drop_session(session)
            self.sessions_expired += 1
            raise FailedPrecondition(
                f"session {clip(sid)} expired: no heartbeat for {self.config.lease_ttl_s:g}s; its "
                "leases and reservations were released; call RegisterSession again")
        return session

    def renew(self, session: Session, now: float) -> None:
        """Push `session`'s deadline back: a call of it succeeded."""
        session.expires_at = now + self.config.lease_ttl_s

    def heartbeat(self, sid: SessionId, now: float, owner: Identity = LOCAL) -> None:
        self.renew(self.session(sid, now, owner), now)

    def close_session(self, sid: SessionId, now: float, owner: Identity = LOCAL) -> None:
        self._drop_session(self.session(sid, now, owner))

    def _drop_session(self, session: Session) -> None:
        for lid in list(session.leases):
            self._release(self.leases[lid], discard=(), now=session.expires_at)
        for rid in list(session.reservations):
            self._abort(self.reservations[rid], Event.ABORT)
        session.ns.sessions -= 1
        self._sessions.forget(session)

    # ------------------------------------------------------------ keys
    def _check_keys(self, keys: Sequence[bytes], *, unique: bool) -> list[bytes]:
        """The keys as immutable bytes (a bytearray is unhashable), or InvalidArgument."""
        if len(keys) > self.config.max_keys_per_call:
            raise InvalidArgument(
                f"{len(keys)} keys in one call; at most {self.config.max_keys_per_call}: split the call")
        kb = self.config.key_bytes
        out = list(keys)
        # Fast path, two C-level passes: every key is bytes of the right length.
        if not (set(map(type, out)) <= {bytes} and set(map(len, out)) <= {kb}):
            for i, k in enumerate(out):
                if not isinstance(k, (bytes, bytearray)):
                    raise InvalidArgument(
                        f"key {i} is a {type(k).__name__}, not bytes; every key must be {kb} bytes")
                if len(k) != kb:
                    raise InvalidArgument(f"key {i} has {len(k)} bytes; every key must be {kb} bytes")
            out = [bytes(k) for k in out]
        if unique and len(set(out)) != len(out):
            raise InvalidArgument("the same key appears twice; each block is saved once per call")
        return out

    # ------------------------------------------------------------ match / lease
    def match(self, sid: SessionId, keys: Sequence[bytes], *, lease: bool, now: float,
              internal: bool = False, counted_elsewhere: Collection[int] = (),
              report_use: bool = False, owner: Identity = LOCAL) -> MatchResult:
        """Count leading committed keys; with `lease`, pin them until release().

        `internal` pins for the daemon's own work (flushing to a lower tier):
        no lookup, no hit, no change to the eviction order. The hits at the
        positions in `counted_elsewhere` came from a lower tier, which counts them.
        With `report_use` no key counts as asked and no block as a hit: the
        client reports its use with release() (see usage.py).
        """
        session = self.session(sid, now, owner)
        keys = self._check_keys(keys, unique=False)
        blocks = session.ns.blocks
        hit: list[Block] = []
        for k in keys:
            b = blocks.get(k)  # type: ignore[call-overload]
            if b is None or b.state is not S.COMMITTED:
                break
            hit.append(b)
        if not internal:
            self.lookups += 1
            self.lookup_keys += len(keys)
            # Tail first, so that within a chain the head is the most recently used
            # and eviction takes the tail: a prefix that loses its head is unmatchable.
            for b in reversed(hit):
                if b.refs == 0:
                    b.tier.policy.hit(b)
                else:
                    b.hits += 1
                b.last_used = now
            if not report_use:
                self.usage.asked(session.ns, len(keys))
                self.usage.hits(session.ns, hit, self.top, len(self.tiers) == 1, counted_elsewhere)
        lease_id = None
        if lease and hit:
            for b in hit:
                self._pin(b)
            lease_id = LeaseId(self._next_lease)
            self._next_lease += 1
            self.leases[lease_id] = Lease(lease_id, session, hit, report_use=report_use,
                                          lower=frozenset(counted_elsewhere))
            session.leases.add(lease_id)
        tiers = ([self.top.name] * len(hit) if len(self.tiers) == 1
                 else [b.tier.name for b in hit])
        self.renew(session, now)
        return MatchResult(len(hit), tiers, lease_id)

    def lease(self, sid: SessionId, lease_id: int, now: float, owner: Identity = LOCAL) -> Lease:
        """The session's lease `lease_id` (a lookup: it renews nothing). Another
        session's lease is answered as one released: leases are reachable only
        through their own session."""
        session = self.session(sid, now, owner)
        lease = self.leases.get(LeaseId(lease_id))
        if lease is None or lease.session is not session:
            self._raise_unknown_lease(lease_id)
        return lease

    def release(self, sid: SessionId, lease_id: int, now: float, *, discard: bool = False,
                discard_indices: Sequence[int] = (),
                report: Optional[LookupReport] = None, owner: Identity = LOCAL) -> int:
        """Drop a lease. Blocks to discard (all with `discard`, or those at
        `discard_indices`) are reclaimed at once when no other lease holds them.

        `report`: what the lookup of a report_use Match was used for, counted
        now; lease_id 0 reports a lookup that leased nothing. Returns how many
        of the lease's blocks the report counts as loaded."""
        if report is not None and not lease_id:
            self.report(sid, report, now, owner)
            return 0
        lease = self.lease(sid, lease_id, now, owner)
        n = len(lease.blocks)
        bad = [i for i in discard_indices if not 0 <= i < n]
        if bad:
            raise InvalidArgument(
                f"discard index {bad[0]} is outside lease {lease_id} of {n} blocks")
        loaded: list[Block] = []
        if report is not None:
            loaded = self._reported_blocks(lease, report)
        drop: Iterable[Block] = lease.blocks if discard else [lease.blocks[i] for i in discard_indices]
        if report is not None:
            # Validated above: nothing fails from here on.
            self.usage.reported(lease.session.ns, report)
            self.usage.hits(lease.session.ns, loaded, self.top, len(self.tiers) == 1,
                            lease.lower, first=report.local_blocks)
        self._release(lease, discard=drop, now=now)
        self.renew(lease.session, now)
        return len(loaded)

    def report(self, sid: SessionId, report: LookupReport, now: float,
               owner: Identity = LOCAL) -> None:
        """Count a report_use lookup that leased nothing (so loaded nothing)."""
        session = self.session(sid, now, owner)
        report.validate(session.ns.block_tokens)
        if report.loaded_blocks:
            raise InvalidArgument(
                f"report: {report.loaded_blocks} blocks loaded without a lease; report a "
                "load with the Release of the lease it came from")
        self.usage.reported(session.ns, report)
        self.renew(session, now)

    def _reported_blocks(self, lease: Lease, report: LookupReport) -> list[Block]:
        """The lease's blocks the report says were loaded, or InvalidArgument."""
        report.validate(lease.session.ns.block_tokens)
        if not lease.report_use:
            raise InvalidArgument(
                f"lease {lease.id} came from a Match without report_use, which counted its "
                "hits already; release it without a report")
        start = report.local_blocks - lease.first
        end = start + report.loaded_blocks
        if report.loaded_blocks and not (0 <= start and end <= len(lease.blocks)):
            raise InvalidArgument(
                f"report: blocks [{report.local_blocks}, {report.local_blocks + report.loaded_blocks})"
                f" loaded, but lease {lease.id} holds lookup positions [{lease.first}, "
                f"{lease.first + len(lease.blocks)})")
        return lease.blocks[start:end] if report.loaded_blocks else []

    def narrow(self, sid: SessionId, lease_id: int, start: int, count: int, now: float,
               owner: Identity = LOCAL) -> None:
        """Unpin the lease's blocks outside positions [start, start + count); it
        keeps the rest, at positions 0..count-1 (e.g. once the client knows it
        holds the leading ones itself)."""
        lease = self.lease(sid, lease_id, now, owner)
        n = len(lease.blocks)
        if count <= 0 or start < 0 or start + count > n:
            raise InvalidArgument(
                f"keep [{start}, {start + count}) is not a non-empty range of lease {lease_id} "
                f"of {n} blocks")
        kept = lease.blocks[start:start + count]
        for b in reversed(lease.blocks[start + count:]):   # tail first, as in match()
            self._unpin(b, now)
        for b in reversed(lease.blocks[:start]):
            self._unpin(b, now)
        lease.blocks = kept
        lease.first += start
        self.renew(lease.session, now)

    def _raise_unknown_lease(self, lease_id: int) -> None:
        if 0 < lease_id < self._next_lease:
            raise FailedPrecondition(
                f"lease {lease_id} was already released, its session expired, or it is another "
                "session's; release each lease exactly once, through its own session")
        raise NotFound(f"unknown lease {lease_id}; leases come from Match with lease=true")

    def _release(self, lease: Lease, *, discard: Iterable[Block], now: float) -> None:
        for b in reversed(lease.blocks):  # tail first, as in match()
            self._unpin(b, now)
        for b in discard:
            if b.refs == 0 and b.state is S.COMMITTED:
                b.tier.policy.remove(b)
                b.tier.evictable_pages -= b.ns.pages_per_block
                self._drop(b, Event.RECLAIM, "discarded")
        del self.leases[lease.id]
        lease.session.leases.discard(lease.id)

    # ------------------------------------------------------------ save
    def reserve(self, sid: SessionId, keys: Sequence[bytes], now: float, *,
                track_writes: bool = False, owner: Identity = LOCAL) -> ReserveResult:
        """Take capacity for the keys not yet stored, all or nothing.

        With `track_writes` the bytes arrive through record_write() and commit
        refuses blocks that are not complete.
        """
        session = self.session(sid, now, owner)
        keys = self._check_keys(keys, unique=True)
        ns = session.ns
        tier = self.top
        statuses: list[str] = []
        new: list[int] = []
        # Unreferenced blocks this call reports PRESENT: the caller will not write
        # them, so making room for the tail must not evict them.
        present: list[Block] = []
        for i, k in enumerate(keys):
            b = ns.blocks.get(k)  # type: ignore[call-overload]
            if b is None:
                statuses.append(SlotStatus.RESERVED)
                new.append(i)
            elif b.state is S.COMMITTED:
                statuses.append(SlotStatus.PRESENT)
                if b.refs == 0 and b.tier is tier:
                    present.append(b)
            else:
                statuses.append(SlotStatus.IN_FLIGHT)
        expires_at = now + self.config.reservation_timeout_s
        if not new:
            self.renew(session, now)
            return ReserveResult(None, statuses, [None] * len(keys), expires_at)
        needed = len(new) * ns.pages_per_block
        if self.quotas:
            quota = quota_for(self.quotas, ns.descriptor.model_id)
            if quota is not None:
                check_quota(namespace=ns.id.hex(), model_id=ns.descriptor.model_id,
                            quota_bytes=quota, used_bytes=ns.used_pages * tier.page_bytes,
                            needed_bytes=needed * tier.page_bytes, blocks=len(new))
        protected = len(present) * ns.pages_per_block
        evictable = tier.evictable_pages - protected
        if needed > tier.free_pages + evictable:
            also = f", not counting the {len(present)} present in this call" if present else ""
            raise ResourceExhausted(
                f"{tier.name} tier: saving {len(new)} blocks needs {needed} pages but only "
                f"{tier.free_pages} are free and {evictable} evictable{also} "
                f"({tier.pinned_pages} pinned by leases or writes); queue, preempt or skip the save")
        if tier.free_pages < needed:
            for b in present:
                tier.policy.remove(b)
            try:
                while tier.free_pages < needed:
                    self._evict_one(tier, "capacity")
            finally:
                # Back as just used, tail first as in match().
                for b in reversed(present):
                    tier.policy.add(b)
        entries: list[Optional[Block]] = [None] * len(keys)
        for i in new:
            key = BlockKey(bytes(keys[i]))
            next_state(key, S.ABSENT, E.RESERVE)
            b = Block(key, ns, tier, tier.pages.alloc(ns.pages_per_block), now)
            ns.blocks[key] = b
            ns.used_pages += ns.pages_per_block
            tier.blocks += 1
            tier.pending_blocks += 1
            entries[i] = b
        rid = ReservationId(self._next_reservation)
        self._next_reservation += 1
        written = [0] * len(keys) if track_writes else None
        self.reservations[rid] = Reservation(rid, session, entries, expires_at, written)
        session.reservations.add(rid)
        self.renew(session, now)
        return ReserveResult(rid, statuses, entries, expires_at)

    def reservation(self, sid: SessionId, rid: int, now: float,
                    owner: Identity = LOCAL) -> Reservation:
        """The session's open reservation `rid` (a lookup: it renews nothing).
        Another session's is answered as one no longer open."""
        session = self.session(sid, now, owner)
        res = self.reservations.get(ReservationId(rid))
        if res is None or res.session is not session:
            if 0 < rid < self._next_reservation:
                raise FailedPrecondition(
                    f"reservation {rid} is no longer open in this session (committed, aborted, "
                    f"timed out after {self.config.reservation_timeout_s:g}s, or another "
                    "session's); reserve again")
            raise NotFound(f"unknown reservation {rid}; call ReserveSave first")
        if res.expires_at < now:
            # Timed out but not yet swept: the same outcome as after expire(now).
            self._abort(res, E.TIMEOUT)
            self.reservations_timed_out += 1
            raise FailedPrecondition(
                f"reservation {rid} timed out after {self.config.reservation_timeout_s:g}s "
                "without a commit; its blocks were released; reserve again")
        return res

    def record_write(self, res: Reservation, index: int, offset: int, length: int) -> Block:
        """Account for `length` streamed bytes at `offset` of entry `index`; chunks come in order."""
        if res.written is None:
            raise FailedPrecondition(
                f"reservation {res.id} was made for shared memory; write the extents directly")
        if not 0 <= index < len(res.entries) or res.entries[index] is None:
            raise InvalidArgument(
                f"key {index} of reservation {res.id} was not reserved (present, in flight or "
                "out of range); write only SLOT_RESERVED entries")
        b = res.entries[index]
        assert b is not None
        done = res.written[index]
        if offset != done:
            raise InvalidArgument(
                f"key {index}: chunk at offset {offset}, expected {done}; send each block's chunks in order")
        if offset + length > b.ns.block_bytes:
            raise OutOfRange(
                f"key {index}: {offset + length} bytes is past the block size {b.ns.block_bytes}")
        res.written[index] = done + length
        return b

    def commit(self, sid: SessionId, rid: int, now: float, *, checksum_algo: int = 0,
               checksums: Sequence[int] = (), owner: Identity = LOCAL) -> int:
        """Make a reservation's blocks visible to Match. Returns how many."""
        res = self.reservation(sid, rid, now, owner)
        if checksums and len(checksums) != len(res.entries):
            raise InvalidArgument(
                f"{len(checksums)} checksums for a reservation of {len(res.entries)} keys; "
                "send one per key or none")
        if res.written is not None:
            for i, b in enumerate(res.entries):
                if b is not None and res.written[i] != b.ns.block_bytes:
                    raise FailedPrecondition(
                        f"key {i} received {res.written[i]} of {b.ns.block_bytes} bytes; "
                        "finish WriteBlocks before CommitSave, or abort")
        committed = 0
        for i, b in reversed(list(enumerate(res.entries))):  # tail first, as in match()
            if b is None:
                continue
            b.state = next_state(b, b.state, E.COMMIT)
            if checksums:
                b.checksum = (checksum_algo, checksums[i])
            b.last_used = now
            tier = b.tier
            tier.pending_blocks -= 1
            tier.committed_blocks += 1
            tier.committed_bytes += b.ns.block_bytes
            tier.policy.add(b)
            tier.evictable_pages += b.ns.pages_per_block
            committed += 1
        del self.reservations[res.id]
        res.session.reservations.discard(res.id)
        self.renew(res.session, now)
        return committed

    def abort(self, sid: SessionId, rid: int, now: float, owner: Identity = LOCAL) -> None:
        res = self.reservation(sid, rid, now, owner)
        self._abort(res, E.ABORT)
        self.renew(res.session, now)

    def _abort(self, res: Reservation, event: Event) -> None:
        reason = "aborted" if event is E.ABORT else "reservation_timeout"
        for b in res.blocks:
            b.tier.pending_blocks -= 1
            self._drop(b, event, reason)
        del self.reservations[res.id]
        res.session.reservations.discard(res.id)

    # ------------------------------------------------------------ time
    def expire(self, now: float) -> ExpiryReport:
        """Drop sessions that missed their heartbeat and reservations never committed."""
        report = ExpiryReport()
        for session in [s for s in self.sessions.values() if s.expires_at < now]:
            self._drop_session(session)
            self.sessions_expired += 1
            report.sessions.append(session.id)
        for res in [r for r in self.reservations.values() if r.expires_at < now]:
            self._abort(res, E.TIMEOUT)
            self.reservations_timed_out += 1
            report.reservations.append(res.id)
        return report

    # ------------------------------------------------------------ admin
    def reclaim_unpinned(self, namespace: Optional[NamespaceId] = None) -> int:
        """Drop every unreferenced committed block (of one namespace, or all)."""
        count = 0
        for ns in self.namespaces.values():
            if namespace is not None and ns.id != namespace:
                continue
            for b in [b for b in ns.blocks.values() if b.state is S.COMMITTED and b.refs == 0]:
                b.tier.policy.remove(b)
                b.tier.evictable_pages -= ns.pages_per_block
                self._drop(b, E.RECLAIM, "admin")
                count += 1
        return count

    def block(self, ns_id: NamespaceId, key: bytes) -> Optional[Block]:
        ns = self.namespaces.get(ns_id)
        return None if ns is None else ns.blocks.get(BlockKey(key))

    # ------------------------------------------------------------ internals
    def _pin(self, b: Block) -> None:
        next_state(b, b.state, E.PIN, b.refs)
        if b.refs == 0:
            b.tier.policy.remove(b)
            b.tier.evictable_pages -= b.ns.pages_per_block
        b.refs += 1

    def _unpin(self, b: Block, now: float) -> None:
        next_state(b, b.state, E.UNPIN, b.refs)
        b.refs -= 1
        b.last_used = now
        if b.refs == 0:
            b.tier.policy.add(b)
            b.tier.evictable_pages += b.ns.pages_per_block

    def _evict_one(self, tier: Tier, reason: str) -> None:
        b = tier.policy.pop()
        if b is None:
            raise InvariantViolation(f"{tier.name}: evictable_pages={tier.evictable_pages} but no victim")
        tier.evictable_pages -= b.ns.pages_per_block
        self._drop(b, E.EVICT, reason)

    def _drop(self, b: Block, event: Event, reason: str) -> None:
        """Remove `b` from the ledger and free its pages. It is already unlinked."""
        b.state = next_state(b, b.state, event, b.refs)
        tier = b.tier
        tier.pages.free(b.pages, b.ns.pages_per_block)
        b.ns.used_pages -= b.ns.pages_per_block
        tier.blocks -= 1
        tier.evictions[reason] += 1
        del b.ns.blocks[b.key]

    # ------------------------------------------------------------ invariants
    def check_invariants(self) -> None:
        """Raise InvariantViolation unless the books balance. O(blocks): for tests and audits."""
        def bad(msg: str) -> None:
            raise InvariantViolation(msg)

        lease_refs: dict[int, int] = {}
        for lease in self.leases.values():
            if lease.id not in lease.session.leases or lease.session.id not in self.sessions:
                bad(f"lease {lease.id} is not owned by a live session")
            for b in lease.blocks:
                if b.state is not S.COMMITTED:
                    bad(f"lease {lease.id} holds {b.label()} in state {b.state.value}")
                lease_refs[id(b)] = lease_refs.get(id(b), 0) + 1
        pending_ids = {id(b) for r in self.reservations.values() for b in r.blocks}
        for ns in self.namespaces.values():
            if ns.used_pages != len(ns.blocks) * ns.pages_per_block:
                bad(f"namespace {ns.id.hex()[:8]} counts {ns.used_pages} pages but its "
                    f"{len(ns.blocks)} blocks hold {len(ns.blocks) * ns.pages_per_block}")
        for tier in self.tiers.values():
            owned: set[int] = set()
            used = evictable = blocks = pending = 0
            for ns in self.namespaces.values():
                for key, b in ns.blocks.items():
                    if b.tier is not tier:
                        continue
                    if b.key != key or b.ns is not ns:
                        bad(f"{b.label()} is filed under the wrong key or namespace")
                    blocks += 1
                    n = ns.pages_per_block
                    pages = set(iter_pages(b.pages, n))
                    if len(pages) != n or pages & owned:
                        bad(f"{b.label()} shares pages with another block")
                    owned |= pages
                    used += n
                    if b.refs != lease_refs.get(id(b), 0) or b.refs < 0:
                        bad(f"{b.label()} has refs={b.refs} but {lease_refs.get(id(b), 0)} lease refs")
                    if b.state is S.PENDING:
                        pending += 1
                        if id(b) not in pending_ids:
                            bad(f"{b.label()} is pending without a reservation")
                    elif b.state is S.COMMITTED:
                        if b.refs == 0:
                            evictable += n
                    else:
                        bad(f"{b.label()} is in terminal state {b.state.value} but still filed")
            if used != tier.used_pages:
                bad(f"{tier.name}: blocks hold {used} pages, allocator says {tier.used_pages}")
            if owned & tier.pages.free_set():
                bad(f"{tier.name}: a page is both free and owned")
            if tier.free_pages < 0 or tier.used_pages > tier.capacity_pages:
                bad(f"{tier.name}: free pages negative")
            if evictable != tier.evictable_pages:
                bad(f"{tier.name}: evictable pages {tier.evictable_pages}, expected {evictable}")
            in_policy = list(tier.policy)
            if len(in_policy) != len(tier.policy):
                bad(f"{tier.name}: policy length disagrees with its contents")
            for b in in_policy:
                if b.state is not S.COMMITTED or b.refs != 0:
                    bad(f"{b.label()} is evictable but state={b.state.value} refs={b.refs}")
            if sum(b.ns.pages_per_block for b in in_policy) != evictable:
                bad(f"{tier.name}: policy holds a different set than the unreferenced committed blocks")
            if blocks != tier.blocks or pending != tier.pending_blocks:
                bad(f"{tier.name}: block counters {tier.blocks}/{tier.pending_blocks}, "
                    f"expected {blocks}/{pending}")
        for session in self.sessions.values():
            for lid in session.leases:
                if self.leases.get(lid) is None or self.leases[lid].session is not session:
                    bad(f"session {session.id} lists lease {lid} it does not hold")
            for rid in session.reservations:
                if self.reservations.get(rid) is None or self.reservations[rid].session is not session:
                    bad(f"session {session.id} lists reservation {rid} it does not hold")
