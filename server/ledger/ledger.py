"""The block ledger: a pure, synchronous state machine (no asyncio, no grpc, no I/O).

Callers pass the time in (`now`, seconds on a monotonic clock), so tests drive
expiry without sleeping and the gRPC servicer stays a thin adapter.
Every public method either completes or raises a ClientError having changed
nothing; `check_invariants()` states what must hold between calls.

The ledger keeps the book of every tier: the page tiers' (the host arena) here
and in saves.py, the byte books of the tiers below in lower.py. Moving bytes is
the tier stack's (tiers/stack.py): it asks where blocks are and tells what moved.
The daemon's own pins and reservations belong to one internal holder
(records.Internal), not to a session.
"""
from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter
from typing import Callable, Iterable, Mapping, Optional, Sequence

from ..errors import FailedPrecondition, InvalidArgument, NotFound
from ..ids import LOCAL, BlockKey, Identity, LeaseId, NamespaceId, ReservationId, SessionId, TierName
from ..quoting import clip
from . import books
from .chains import private_run
from .disk_index import DiskIndex
from .events import DEFAULT_CAPACITY_KEYS, EventLog, TierEvents
from .invariants import check_ledger
from .lower import LowerBooks
from .policy import DEFAULT_POLICY
from .records import (SWEEP_MIN, Block, Internal, Lease, Namespace, NamespaceDescriptor,
                      Reservation, Session, sweep_namespaces)
from .residency import Residency
from .results import ExpiryReport, MatchResult
from .routing import RoutingCalls
from .saves import Saves
from .sessions import CLOSED, DISCONNECTED, EXPIRED, REVOKED, SessionTable, Watch
from .states import BlockState, Event
from .tier import Tier, TierSpec
from .units import pages_for_bytes
from .usage import LookupReport, Usage

S, E = BlockState, Event
_REFS = attrgetter("refs")
# Parent hints kept per namespace (saves a Match was the lookup of); oldest dropped.
HINTS = 4096


@dataclass(frozen=True)
class LedgerConfig:
    tiers: Sequence[TierSpec]
    policy: str = DEFAULT_POLICY
    key_bytes: int = 32
    max_keys_per_call: int = 4096
    lease_ttl_s: float = 30.0
    reservation_timeout_s: float = 60.0
    # The residency events' replay buffer, in keys (events.py).
    event_buffer_keys: int = DEFAULT_CAPACITY_KEYS
    # Each run starts past the last run's (schema.py): an old release frees no new lease.
    first_lease_id: int = 1
    max_sessions_per_identity: int = 0   # 0: no limit (sessions.py)


class Ledger(Saves, LowerBooks, RoutingCalls):
    def __init__(self, config: LedgerConfig, quotas: Optional[Mapping[str, int]] = None) -> None:
        if not config.tiers:
            raise ValueError("the ledger needs at least one tier")
        self.config = config
        # Model id (or "*") -> host-tier bytes per namespace (see quota.py). Not part of
        # the frozen config: a reload replaces it while sessions go on.
        self.quotas: dict[str, int] = dict(quotas or {})
        self.tiers: dict[TierName, Tier] = {t.name: Tier(t, config.policy) for t in config.tiers}
        # New blocks land in the first page tier; the tiers below keep copies (lower.py).
        self.top: Tier = self.tiers[config.tiers[0].name]
        # The books of the tiers below the page tiers, in lookup order (add_book).
        self.lower: dict[TierName, DiskIndex] = {}
        self.namespaces: dict[NamespaceId, Namespace] = {}
        self.session_table = SessionTable(config.max_sessions_per_identity)
        # The live sessions by id, and the table (read by metrics, admin, tests; changed here).
        self.sessions: dict[SessionId, Session] = self.session_table.live
        self.internal = Internal()
        self.leases: dict[LeaseId, Lease] = {}
        self.reservations: dict[ReservationId, Reservation] = {}
        self._first_lease = self._next_lease = config.first_lease_id
        self._next_reservation = 1
        self.lookups = self.lookup_keys = self.reservations_timed_out = 0   # for the metrics
        self.usage = Usage()
        self._sweep_at = SWEEP_MIN   # namespaces: see records.sweep_namespaces
        # The gpu tier: what each engine's own KV cache holds (residency.py).
        self.residency = Residency(EventLog(config.event_buffer_keys))
        for t in self.tiers.values():
            t.events = TierEvents(self.residency.log, t.name)

    # ------------------------------------------------------------ sessions
    def register_session(self, instance_id: str, descriptor: NamespaceDescriptor,
                         now: float, *, owner: Identity = LOCAL) -> Session:
        if len(instance_id.encode()) > 256:
            raise InvalidArgument("instance_id is longer than 256 bytes")
        descriptor.validate()
        self.session_table.check_room(owner)   # before anything changes: the namespace too
        ns = self.namespaces.get(descriptor.digest())
        if ns is None:
            ppb = pages_for_bytes(descriptor.block_bytes, self.top.page_bytes)
            if ppb > self.top.capacity_pages:
                raise InvalidArgument(
                    f"a block of {descriptor.block_bytes} B does not fit in the {self.top.name} tier "
                    f"({self.top.capacity_pages * self.top.page_bytes} B); raise its capacity")
            self._sweep_at = sweep_namespaces(self.namespaces, self._sweep_at)
            ns = Namespace(descriptor, ppb)
            self.namespaces[ns.id] = ns
        session = Session(self.session_table.new_id(), instance_id, ns,
                          now + self.config.lease_ttl_s, owner)
        ns.sessions += 1
        self.session_table.add(session)
        return session

    def session(self, sid: SessionId, now: float, owner: Identity = LOCAL) -> Session:
        """The live session `sid` of `owner`. Only a call that succeeds renews it."""
        session = self.session_table.resolve(sid, owner)
        if session.expires_at < now:
            self._drop_session(session, EXPIRED)
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
        self._drop_session(self.session(sid, now, owner), CLOSED)

    def revoke(self, sids: Iterable[SessionId]) -> None:
        """End these live sessions now: a reload took their model from their token."""
        for session in [self.sessions[s] for s in dict.fromkeys(sids) if s in self.sessions]:
            self._drop_session(session, REVOKED)   # once each, whatever the caller repeats

    def watch(self, sid: SessionId, now: float, owner: Identity,
              on_end: Callable[[str], None]) -> Watch:
        """A call now watches the live session `sid` (and renews it): on_end(reason)
        when the session ends; the end of its last watch ends it (unwatch)."""
        session = self.session(sid, now, owner)
        w = self.session_table.watch(session, on_end)
        self.renew(session, now)
        return w

    def unwatch(self, w: Watch) -> bool:
        """The call of watch `w` ended. Returns whether that ended its session
        (its last watch, the session still live: the client is gone, so its
        leases and reservations are freed now). Never fails."""
        session = self.session_table.unwatch(w)
        if session is None:
            return False
        self._drop_session(session, DISCONNECTED)
        return True

    @property
    def session_ends(self) -> Mapping[str, int]:
        """Sessions ended so far, by reason (sessions.END_REASONS)."""
        return self.session_table.ends

    @property
    def sessions_expired(self) -> int:
        return self.session_table.ends[EXPIRED]

    def _drop_session(self, session: Session, reason: str) -> None:
        for lid in list(session.leases):
            self._release(self.leases[lid], discard=(), now=session.expires_at)
        for rid in list(session.reservations):
            self._abort(self.reservations[rid], Event.ABORT, reason != CLOSED)
        session.ns.sessions -= 1
        self.residency.drop(session.id)
        self.session_table.forget(session, reason)

    # ------------------------------------------------------------ keys
    def check_keys(self, keys: Sequence[bytes], *, unique: bool) -> list[bytes]:
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
              below: Mapping[int, TierName] = {}, report_use: bool = False,
              owner: Identity = LOCAL) -> MatchResult:
        """Count leading committed keys; with `lease`, pin them until release().

        `below`: positions whose block a lower tier served (the tier stack
        promoted it into the top tier first); their hits are that tier's.
        With `report_use` no key counts as asked and no block as a hit: the
        client reports its use with release() (see usage.py).
        """
        session = self.session(sid, now, owner)
        keys = self.check_keys(keys, unique=False)
        committed = S.COMMITTED
        hit: list[Block] = []
        for b in map(session.ns.blocks.get, keys):
            if b is None or b.state is not committed:
                break
            b.last_used = now
            hit.append(b)
        self.lookups += 1
        self.lookup_keys += len(keys)
        if hit and len(hit) < len(keys):   # a save of the first key missed will likely
            # follow: its parent is the last hit (saves.py _first_parent), unless it names one.
            hints = session.ns.hints
            hints[keys[len(hit)]] = hit[-1]  # type: ignore[index]
            if len(hints) > HINTS:   # the oldest; popitem(last=False) is O(1)
                hints.popitem(last=False)
        # Tail first, so that within a chain the head is the most recently used
        # and eviction takes the tail: a prefix that loses its head is unmatchable.
        # The first `rereads` of them are the reader's own history (chains.private_run).
        rereads = 0 if session.ns.says_last_turn else private_run(hit)
        if any(map(_REFS, hit)):  # some are leased: only the others are evictable
            evictable: list[Block] = []
            private, rereads = rereads, 0
            for i, b in enumerate(reversed(hit)):
                if b.refs == 0:
                    evictable.append(b)
                    rereads += i < private
                else:
                    b.hits += 1
        else:
            evictable = hit[::-1]
        if evictable:
            self._hit_evictable(evictable, rereads)
        if not report_use:
            self.usage.asked(session.ns, len(keys))
            self.usage.hits(session.ns, hit, self.top, len(self.tiers) == 1, below)
        lease_id = None
        if lease and hit:
            lease_id = self._new_lease(session, hit, report_use=report_use, below=dict(below)).id
        tiers = ([self.top.name] * len(hit) if len(self.tiers) == 1
                 else [b.tier.name for b in hit])
        self.renew(session, now)
        return MatchResult(len(hit), tiers, lease_id)

    def _hit_evictable(self, blocks: list[Block], rereads: int) -> None:
        """policy.hit_all of the run (the first `rereads` rereads), one run per tier."""
        if len(self.tiers) == 1:
            self.top.policy.hit_all(blocks, rereads)
            return
        for t in self.tiers.values():
            mine = [i for i, b in enumerate(blocks) if b.tier is t]
            if mine:
                t.policy.hit_all([blocks[i] for i in mine], sum(i < rereads for i in mine))

    def count_asked(self, ns: Namespace, keys: int, report_use: bool) -> None:
        """Count a Match's keys that the tiers below looked up, not match()."""
        self.lookup_keys += keys
        if not report_use:
            self.usage.asked(ns, keys)

    def _new_lease(self, holder: "Session | Internal", blocks: list[Block],
                   **kw: object) -> Lease:
        for b in blocks:
            books.pin(b)
        lease = Lease(LeaseId(self._next_lease), holder, blocks, **kw)  # type: ignore[arg-type]
        self._next_lease += 1
        self.leases[lease.id] = lease
        holder.leases.add(lease.id)
        return lease

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
                report: Optional[LookupReport] = None, owner: Identity = LOCAL,
                last_turn: bool = False) -> int:
        """Drop a lease. Blocks to discard (all with `discard`, or those at
        `discard_indices`) are reclaimed at once when no other lease holds them.
        `last_turn`: the lookup was a conversation's last turn, so the blocks
        it read are demoted (books.demote) as they become evictable.

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
        session = lease.session
        assert isinstance(session, Session)
        if report is not None:
            # Validated above: nothing fails from here on.
            self.usage.reported(session.ns, report)
            self.usage.hits(session.ns, loaded, self.top, len(self.tiers) == 1,
                            lease.below, first=report.local_blocks)
        session.ns.says_last_turn |= last_turn
        self._release(lease, discard=drop, now=now, demote=last_turn)
        self.renew(session, now)
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
        assert isinstance(lease.session, Session)
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
            books.unpin(b, now)
        for b in reversed(lease.blocks[:start]):
            books.unpin(b, now)
        lease.blocks = kept
        lease.first += start
        assert isinstance(lease.session, Session)
        self.renew(lease.session, now)

    def _raise_unknown_lease(self, lease_id: int) -> None:
        if self._first_lease <= lease_id < self._next_lease:
            raise FailedPrecondition(
                f"lease {lease_id} was already released, its session expired, or it is another "
                "session's; release each lease exactly once, through its own session")
        raise NotFound(f"unknown lease {lease_id}; leases come from Match with lease=true")

    def _release(self, lease: Lease, *, discard: Iterable[Block], now: float,
                 demote: bool = False) -> None:
        for b in reversed(lease.blocks):  # tail first, as in match()
            books.unpin(b, now)
            if demote and books.demote(b) and self.lower:
                self.demote_lower(b.ns, b.key)
        for b in discard:
            if b.refs == 0 and b.state is S.COMMITTED:
                books.reclaim(b, "discarded")
        del self.leases[lease.id]
        lease.session.leases.discard(lease.id)

    def expire(self, now: float) -> ExpiryReport:
        """Drop sessions that missed their heartbeat and reservations never committed."""
        report = ExpiryReport(thawed_pages=sum(t.cooling.thaw(now) for t in self.tiers.values()))
        for session in [s for s in self.sessions.values() if s.expires_at < now]:
            self._drop_session(session, EXPIRED)
            report.sessions.append(session.id)
        # Not a promotion's (internal): its copy may still write the pages; the stack ends it.
        for res in [r for r in self.reservations.values()
                    if r.expires_at < now and r.session is not self.internal]:
            self._abort(res, E.TIMEOUT, True)
            self.reservations_timed_out += 1
            report.reservations.append(res.id)
        return report

    # ------------------------------------------------------------ admin
    def reclaim_unpinned(self, namespace: Optional[NamespaceId] = None) -> int:
        """Drop every unreferenced committed block (of one namespace, or all)."""
        blocks = [b for ns in self.namespaces.values() if namespace in (None, ns.id)
                  for b in ns.blocks.values() if b.state is S.COMMITTED and b.refs == 0]
        for b in blocks:
            books.reclaim(b, "admin")
        return len(blocks)

    def block(self, ns_id: NamespaceId, key: bytes) -> Optional[Block]:
        ns = self.namespaces.get(ns_id)
        return None if ns is None else ns.blocks.get(BlockKey(key))

    def open_reservations(self) -> int:
        """Reservations that sessions hold (the daemon's own are not counted)."""
        return len(self.reservations) - len(self.internal.reservations)

    def check_invariants(self) -> None:
        """Raise InvariantViolation unless the books balance. O(blocks): for tests and audits."""
        check_ledger(self)
