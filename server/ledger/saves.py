"""Saves: reserve capacity, receive streamed bytes, commit or abort.

A part of the Ledger (a mixin: it shares the ledger's tables and counters,
see ledger.py). Reserving runs in steps: sort the keys into new, present and
in-flight; check the quota and the room; make the room (the one eviction
loop in room.py); file the new blocks. Every step before the last only
reads, or undoes what it did, so a refused call changes nothing.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

from ..errors import FailedPrecondition, InvalidArgument, NotFound, OutOfRange, ResourceExhausted
from ..ids import LOCAL, BlockKey, Identity, NamespaceId, ReservationId, SessionId
from . import books
from .chains import GONE, link
from .policy import ADMIT, COLD, COLD_RUN, REFUSE, WARM_RUN
from .quota import check_quota, quota_for
from .records import Block, Holder, Namespace, Reservation
from .results import ReserveResult, SlotStatus
from .room import make_room
from .states import BlockState, Event, next_state
from .tier import Tier

if TYPE_CHECKING:  # pragma: no cover
    from .ledger import Ledger

S, E = BlockState, Event


class Saves:
    """Ledger methods of the save path (see the module docstring)."""

    def reserve(self: "Ledger", sid: SessionId, keys: Sequence[bytes], now: float, *,
                track_writes: bool = False, parent: Optional[bytes] = None,
                owner: Identity = LOCAL) -> ReserveResult:
        """Take capacity for the keys not yet stored, all or nothing.

        The keys are a run of one chain: each key's parent is the key before
        it; `parent` names the first key's (b"" for a chain's first block;
        None: unknown, then the last Match that stopped at keys[0] says).
        With `track_writes` the bytes arrive through record_write() and commit
        refuses blocks that are not complete. The tier's policy may refuse
        the new keys (admit_run: a cold run that would evict): then none is
        reserved, each is NOT_ADMITTED, and nothing is evicted.
        """
        session = self.session(sid, now, owner)
        if parent is not None and not isinstance(parent, (bytes, bytearray, memoryview)):
            raise InvalidArgument(f"parent key must be bytes, got {type(parent).__name__}")
        parent = None if parent is None else bytes(parent)
        if parent is not None and parent and len(parent) != self.config.key_bytes:
            raise InvalidArgument(f"parent key has {len(parent)} bytes; every key must be "
                                  f"{self.config.key_bytes} bytes (b\"\" for a chain's first block)")
        if parent and any(parent == k for k in keys):   # keys are checked in _reserve
            raise InvalidArgument("parent key is one of the keys; name the key before the first")
        r = self._reserve(session, session.ns, keys, now, track_writes, parent)
        self.renew(session, now)
        return r

    def reserve_internal(self: "Ledger", ns_id: NamespaceId, keys: Sequence[bytes],
                         now: float, parent: Optional[bytes] = None) -> ReserveResult:
        """reserve() for the daemon's own work (a promotion from a lower tier):
        held by the ledger's internal holder, not by a session, and never
        refused by admission (a Match asked for the block). `parent` as in
        reserve() (a promoted block's is the key before it in the Match)."""
        return self._reserve(self.internal, self.namespaces[ns_id], keys, now, False, parent,
                             admission=False)

    def _reserve(self: "Ledger", holder: Holder, ns: Namespace, keys: Sequence[bytes],
                 now: float, track_writes: bool, parent: Optional[bytes] = None,
                 admission: bool = True) -> ReserveResult:
        keys = self.check_keys(keys, unique=True)
        tier = self.top
        statuses, new, present = self._sort_keys(ns, keys, tier)
        expires_at = now + self.config.reservation_timeout_s
        if not new:
            return ReserveResult(None, statuses, [None] * len(keys), expires_at)
        needed = len(new) * ns.pages_per_block
        run = ADMIT
        if admission:
            first = new[0]
            run_parent = (ns.blocks[keys[first - 1]] if first
                          else self._first_parent(ns, keys[0], parent, take=False))
            run = tier.policy.admit_run([(ns.id, keys[i]) for i in new], run_parent,
                                        evicts=tier.free_pages < needed)
            if run == REFUSE:
                tier.admission_refused += len(new)
                for i in new:
                    statuses[i] = SlotStatus.NOT_ADMITTED
                return ReserveResult(None, statuses, [None] * len(keys), expires_at)
        self._check_quota(ns, tier, needed, len(new))
        up = self._first_parent(ns, keys[0], parent, take=False) if new[0] == 0 else None
        if up is not None and up is not GONE and up.refs == 0 and up.state is S.COMMITTED \
                and up not in present:
            present = [*present, up]   # room for a save never evicts the block it extends
        self._check_room(tier, needed, len(new), present)
        self._make_room(tier, needed, present)
        entries: list[Optional[Block]] = [None] * len(keys)
        for i in new:
            entries[i] = b = self._file_block(ns, tier, BlockKey(bytes(keys[i])), now)
            link(b, ns.blocks[keys[i - 1]] if i else self._first_parent(ns, keys[0], parent))
            if run == COLD_RUN:
                b.pq |= COLD
            elif run == WARM_RUN:
                b.pq |= 1          # a frequency of 1 (recency.py FREQ)
        rid = ReservationId(self._next_reservation)
        self._next_reservation += 1
        written = [0] * len(keys) if track_writes else None
        self.reservations[rid] = Reservation(rid, holder, ns, entries, expires_at, written)
        holder.reservations.add(rid)
        return ReserveResult(rid, statuses, entries, expires_at)

    @staticmethod
    def _first_parent(ns: Namespace, key: bytes, parent: Optional[bytes],
                      take: bool = True) -> Any:
        """The block before `key` in its chain: the one named, or the one a
        Match that stopped at `key` hit last (that hint is used up unless not
        `take`); GONE when that left; None when `key` starts a chain or nobody said."""
        if parent is None:
            hints = ns.hints
            hinted = (hints.pop if take else hints.get)(key, None)   # type: ignore[operator]
            if hinted is None:
                return None
            parent = hinted.key
        if not parent:
            return None
        b = ns.blocks.get(parent)  # type: ignore[call-overload]
        return GONE if b is None else b

    @staticmethod
    def _sort_keys(ns: Namespace, keys: Sequence[bytes],
                   tier: Tier) -> tuple[list[str], list[int], list[Block]]:
        """Each key's status, the positions of the new ones, and the unreferenced
        blocks reported PRESENT: the caller will not write those, so making room
        for the rest must not evict them."""
        statuses: list[str] = []
        new: list[int] = []
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
        return statuses, new, present

    def _check_quota(self: "Ledger", ns: Namespace, tier: Tier, needed: int, blocks: int) -> None:
        if not self.quotas:
            return
        quota = quota_for(self.quotas, ns.descriptor.model_id)
        if quota is not None:
            check_quota(namespace=ns.id.hex(), model_id=ns.descriptor.model_id,
                        quota_bytes=quota, used_bytes=ns.used_pages * tier.page_bytes,
                        needed_bytes=needed * tier.page_bytes, blocks=blocks)

    @staticmethod
    def _check_room(tier: Tier, needed: int, blocks: int, present: list[Block]) -> None:
        protected = sum(b.ns.pages_per_block for b in present)
        evictable = tier.evictable_pages - protected
        if needed > tier.free_pages + evictable:
            also = f", not counting the {len(present)} present in this call" if present else ""
            cool = tier.cooling.pages
            held = (f"{tier.pinned_pages - cool} pinned by leases or writes" + (
                f", {cool} kept out of use for a while after reservations the daemon ended"
                if cool else ""))
            raise ResourceExhausted(
                f"{tier.name} tier: saving {blocks} blocks needs {needed} pages but only "
                f"{tier.free_pages} are free and {evictable} evictable{also} "
                f"({held}); queue, preempt or skip the save")

    def _make_room(self: "Ledger", tier: Tier, needed: int, present: list[Block]) -> None:
        if tier.free_pages >= needed:
            return
        for b in present:
            tier.policy.remove(b)
        try:
            make_room(tier.policy, tier.free_pages, needed,
                      lambda b: books.evict(b, self.eviction_reason(b)), tier.name)
        finally:
            # Back as just used, tail first as in match().
            for b in reversed(present):
                tier.policy.add(b)

    @staticmethod
    def _file_block(ns: Namespace, tier: Tier, key: BlockKey, now: float) -> Block:
        next_state(key, S.ABSENT, E.RESERVE)
        b = Block(key, ns, tier, tier.pages.alloc(ns.pages_per_block), now)
        ns.blocks[key] = b
        ns.used_pages += ns.pages_per_block
        tier.blocks += 1
        tier.pending_blocks += 1
        return b

    def reservation(self: "Ledger", sid: SessionId, rid: int, now: float,
                    owner: Identity = LOCAL) -> Reservation:
        """The session's open reservation `rid` (a lookup: it renews nothing).
        Another session's is answered as one no longer open."""
        return self._open_reservation(self.session(sid, now, owner), rid, now)

    def _open_reservation(self: "Ledger", holder: Holder, rid: int, now: float) -> Reservation:
        res = self.reservations.get(ReservationId(rid))
        if res is None or res.session is not holder:
            if 0 < rid < self._next_reservation:
                raise FailedPrecondition(
                    f"reservation {rid} is no longer open in this session (committed, aborted, "
                    f"timed out after {self.config.reservation_timeout_s:g}s, or another "
                    "session's); reserve again")
            raise NotFound(f"unknown reservation {rid}; call ReserveSave first")
        if res.expires_at < now:
            # Timed out but not yet swept: the same outcome as after expire(now).
            self._abort(res, E.TIMEOUT, True)
            self.reservations_timed_out += 1
            raise FailedPrecondition(
                f"reservation {rid} timed out after {self.config.reservation_timeout_s:g}s "
                "without a commit; its blocks were released; reserve again")
        return res

    def record_write(self, res: Reservation, index: int, offset: int, length: int) -> Block:
        """Account for `length` streamed bytes at `offset` of entry `index`; chunks come in order."""
        b = self._writable(res, index, offset, length)
        assert res.written is not None
        res.written[index] = offset + length
        return b

    def record_whole(self, res: Reservation, index: int, count: int) -> list[Block]:
        """Account for whole blocks index..index + count - 1 (a packed chunk):
        every one is checked before any is recorded, so a chunk that fails
        records nothing and the client may send its entries again."""
        blocks = [self._writable(res, index + j, 0, res.session.ns.block_bytes)
                  for j in range(count)]
        assert res.written is not None
        for j, b in enumerate(blocks):
            res.written[index + j] = b.ns.block_bytes
        return blocks

    def _writable(self, res: Reservation, index: int, offset: int, length: int) -> Block:
        """Entry `index`'s block, if `length` bytes at `offset` are its next ones."""
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
        return b

    def commit(self: "Ledger", sid: SessionId, rid: int, now: float, *, checksum_algo: int = 0,
               checksums: Sequence[int] = (), owner: Identity = LOCAL) -> int:
        """Make a reservation's blocks visible to Match. Returns how many."""
        res = self.reservation(sid, rid, now, owner)
        # A client's (a lower tier's were checked when it read them); a wrong
        # count is _commit's to refuse first.
        if checksums and len(checksums) == len(res.entries):
            check_checksums(checksum_algo, checksums)
        committed = self._commit(res, now, checksum_algo, checksums)
        self.renew(res.session, now)
        return committed

    def commit_internal(self: "Ledger", rid: int, now: float,
                        checksum: Optional[tuple[int, int]] = None) -> int:
        """Commit the daemon's own reservation (a promotion), with the block's
        (algorithm, value) where the tier it came from kept one."""
        algo, sums = (checksum[0], [checksum[1]]) if checksum else (0, ())
        return self._commit(self._open_reservation(self.internal, rid, now), now, algo, sums)

    def _commit(self: "Ledger", res: Reservation, now: float, checksum_algo: int,
                checksums: Sequence[int]) -> int:
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
        ev = self.top.events
        if committed and ev is not None and ev.log.watched:   # one event per commit, in order
            ev.stored(res.ns.id, [b.key for b in res.blocks if b.tier is self.top])
        del self.reservations[res.id]
        res.session.reservations.discard(res.id)
        return committed

    def abort(self: "Ledger", sid: SessionId, rid: int, now: float,
              owner: Identity = LOCAL) -> None:
        res = self.reservation(sid, rid, now, owner)
        self._abort(res, E.ABORT, False)
        self.renew(res.session, now)

    def abort_internal(self: "Ledger", rid: int, now: float) -> None:
        self._abort(self._open_reservation(self.internal, rid, now), E.ABORT, False)

    def _abort(self: "Ledger", res: Reservation, event: Event, writer_may_go_on: bool) -> None:
        """End `res` unwritten. `writer_may_go_on`: the daemon ended it, not its
        client, so its pages stay out of use a while (cooling.py)."""
        reason = "aborted" if event is E.ABORT else "reservation_timeout"
        cool = res.expires_at + self.config.reservation_timeout_s if writer_may_go_on else None
        for b in res.blocks:
            b.tier.pending_blocks -= 1
            books.drop(b, event, reason, cool)
        del self.reservations[res.id]
        res.session.reservations.discard(res.id)


# The API's ChecksumAlgo values a block may be committed with, and each one's
# largest value. A block stored under any other algorithm could never be
# verified: readers skip what they cannot compute, so it would be served
# unchecked; a CRC32 above 32 bits would fail every reader's check.
CHECKSUM_MAX = {1: 0xFFFFFFFF, 2: 0xFFFFFFFFFFFFFFFF}   # CRC32, XXH3_64


def check_checksums(algo: int, checksums: Sequence[int]) -> None:
    """InvalidArgument unless `checksums` can be verified under `algo`
    (CHECKSUM_NONE with all zeros is no checksum: what a client without one sends)."""
    if algo == 0:
        if any(checksums):
            raise InvalidArgument("checksums sent with CHECKSUM_NONE; name their algorithm "
                                  "(CHECKSUM_CRC32 or CHECKSUM_XXH3_64) or send none")
        return
    top = CHECKSUM_MAX.get(algo)
    if top is None:
        raise InvalidArgument(f"checksum algorithm {algo} is unknown; use CHECKSUM_CRC32 (1) or "
                              "CHECKSUM_XXH3_64 (2), or send no checksums")
    for i, c in enumerate(checksums):
        if not 0 <= c <= top:
            raise InvalidArgument(f"key {i}: checksum {c} does not fit algorithm {algo} "
                                  f"(at most {top:#x})")
