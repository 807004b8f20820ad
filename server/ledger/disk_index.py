"""What the disk tier holds: a pure, synchronous index (no I/O, like the ledger).

The disk tier keeps a copy of blocks below the host arena. Its entries are
keyed by (namespace digest, key) rather than by ledger blocks because a disk
copy outlives the arena copy, the session that wrote it and the daemon
process: after a restart the index is rebuilt from the directory before any
namespace is registered again.

An entry's states and the events that move it are the table in states.py
(DiskState, DiskEvent, next_disk_state); every method here that changes an
entry's state goes through it. Eviction takes unpinned stored entries in the
configured policy's order (policy.py), O(1) per entry through the same
intrusive lists as the host tier, and a full book asks the policy whether a
new copy may displace them (its admission rule).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterator, Optional

from ..errors import InvariantViolation, ResourceExhausted
from .policy import make_policy
from .room import make_room
from .states import DiskEvent, DiskState, next_disk_state

# The states importers compare with (admin, tests); str-valued, see DiskState.
WRITING = DiskState.WRITING
STORED = DiskState.STORED

Where = tuple[bytes, bytes]  # (namespace digest, key)


class DiskEntry:
    __slots__ = ("where", "nbytes", "state", "pins", "hits", "prev", "next", "pq")

    def __init__(self, where: Where, nbytes: int) -> None:
        self.where = where
        self.nbytes = nbytes
        self.state = DiskState.ABSENT
        self.pins = 0
        self.hits = 0
        self.prev: Optional[DiskEntry] = None
        self.next: Optional[DiskEntry] = None
        self.pq = 0     # the policy's bits (policy.py)

    def label(self) -> str:
        return f"{self.where[0].hex()[:8]}/{self.where[1].hex()[:16]}"


@dataclass(frozen=True)
class Reservation:
    entry: DiskEntry
    evicted: list[Where]       # files the caller must delete before or after writing


class DiskIndex:
    def __init__(self, capacity_bytes: int, policy: str = "lru") -> None:
        if capacity_bytes <= 0:
            raise ValueError("the disk tier needs a positive capacity")
        self.capacity_bytes = capacity_bytes
        self.entries: dict[Where, DiskEntry] = {}
        self._policy = make_policy(policy)
        self.used_bytes = 0
        self.evictable_bytes = 0
        # Monotonic counters, read by the metrics collector.
        self.evictions: Counter[str] = Counter()
        self.hit_blocks = 0
        self.written_blocks = 0
        self.written_bytes = 0
        self.refused = 0        # copies the policy's admission turned away
        self.last_turn_demoted = 0   # copies a last turn demoted (demote)
        # Where its copies' stored / removed events go (events.TierEvents), if anywhere.
        self.events: Any = None

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, ns: bytes, key: bytes) -> Optional[DiskEntry]:
        """The stored entry for (ns, key), or None (writing counts as absent)."""
        e = self.entries.get((ns, key))
        return e if e is not None and e.state is DiskState.STORED else None

    def reserve(self, ns: bytes, key: bytes, nbytes: int, hits: int = 0,
                admit: bool = True) -> Optional[Reservation]:
        """Take `nbytes` for a new copy, evicting unpinned entries if needed.

        None when a copy exists or is being written already, or when making
        room would evict and the policy does not admit the block (admission:
        s3fifo lets a block that was never hit, `hits` in the arena, displace
        others only when it comes again; counted in `refused`; `admit`
        False: no admission rule, as write-through asks).
        ResourceExhausted, with nothing changed, when even evicting every
        unpinned entry would not make room.
        """
        where = (ns, key)
        if where in self.entries:
            return None
        free = self.capacity_bytes - self.used_bytes
        if admit and nbytes > free and self.evictable_bytes and \
                not self._policy.admits(None, where, hits):
            self.refused += 1
            return None
        if nbytes > free + self.evictable_bytes:
            raise ResourceExhausted(
                f"disk tier: a block of {nbytes} B does not fit ({free} B free, "
                f"{self.evictable_bytes} B evictable of {self.capacity_bytes} B); "
                "raise disk_tier.capacity_bytes or free space")
        evicted: list[Where] = []

        def evict(victim: DiskEntry) -> int:
            self._evict(victim, "capacity")
            evicted.append(victim.where)
            return victim.nbytes

        make_room(self._policy, free, nbytes, evict, "disk tier")
        entry = DiskEntry(where, nbytes)
        self._apply(entry, DiskEvent.RESERVE)
        self.entries[where] = entry
        self.used_bytes += nbytes
        return Reservation(entry, evicted)

    def written(self, entry: DiskEntry) -> None:
        self._apply(entry, DiskEvent.WRITTEN)
        self.written_blocks += 1
        self.written_bytes += entry.nbytes
        self._link(entry)
        if self.events is not None:
            self.events.stored(entry.where[0], [entry.where[1]])

    def failed(self, entry: DiskEntry) -> None:
        self._apply(entry, DiskEvent.FAILED)
        del self.entries[entry.where]
        self.used_bytes -= entry.nbytes

    def adopt(self, ns: bytes, key: bytes, nbytes: int) -> Optional[DiskEntry]:
        """Record a copy found on disk. Over capacity it is not adopted (None):
        the caller may delete the file; nothing else changes."""
        where = (ns, key)
        if where in self.entries:
            return self.entries[where]
        if self.used_bytes + nbytes > self.capacity_bytes:
            return None
        entry = DiskEntry(where, nbytes)
        self._apply(entry, DiskEvent.ADOPT)
        self.entries[where] = entry
        self.used_bytes += nbytes
        self._link(entry)
        if self.events is not None:
            self.events.stored(ns, [key])
        return entry

    def pin(self, entry: DiskEntry) -> None:
        self._apply(entry, DiskEvent.PIN)
        if entry.pins == 0:
            self._unlink(entry)
        entry.pins += 1

    def unpin(self, entry: DiskEntry) -> None:
        """Let go of a pin; also of an entry dropped while pinned (then ABSENT)."""
        self._apply(entry, DiskEvent.UNPIN)
        entry.pins -= 1
        if entry.pins == 0 and entry.state is DiskState.STORED:
            self._link(entry)

    def touch(self, entry: DiskEntry) -> None:
        """A hit: the entry becomes the most recently used. Recency, not a state
        change: an entry that is not stored (any more) only counts the hit."""
        self.hit_blocks += 1
        if entry.pins == 0 and entry.state is DiskState.STORED:
            self._policy.hit(entry)
        else:
            entry.hits += 1

    def demote(self, entry: DiskEntry) -> None:
        """A conversation's last turn read the block: its copy goes first in
        line (the policy's demote) unless it is hit again. Only an unpinned
        stored copy: one being written or read keeps its place."""
        if entry.pins == 0 and entry.state is DiskState.STORED:
            self._policy.demote(entry)
            self.last_turn_demoted += 1

    def drop(self, entry: DiskEntry, reason: str) -> None:
        """Forget a stored copy whose file is gone or corrupt (pins or not).
        Dropping an entry that is gone already (ABSENT) does nothing."""
        if entry.state is DiskState.ABSENT:
            return
        was_stored = entry.state is DiskState.STORED
        self._apply(entry, DiskEvent.DROP)
        if was_stored and entry.pins == 0:
            self._unlink(entry)
        self._remove(entry, reason, was_stored)

    def forget(self, entry: DiskEntry) -> None:
        """Stop booking a stored, unpinned copy without counting an eviction: for
        a tier whose medium decides what it keeps (the cluster), which books
        copies only while it moves them. A pinned or unstored entry stays."""
        if entry.state is not DiskState.STORED or entry.pins:
            return
        self._unlink(entry)
        self._apply(entry, DiskEvent.DROP)
        del self.entries[entry.where]
        self.used_bytes -= entry.nbytes

    def evict_unpinned(self, reason: str = "admin") -> list[Where]:
        out = []
        while True:
            victim = self._policy.pop()
            if victim is None:
                return out
            self._evict(victim, reason)
            out.append(victim.where)

    def __iter__(self) -> Iterator[DiskEntry]:
        return iter(list(self.entries.values()))

    def eviction_order(self) -> list[DiskEntry]:
        """The unpinned stored entries, the next victim first."""
        return list(self._policy)

    # ------------------------------------------------------------ internals
    def _apply(self, entry: DiskEntry, event: DiskEvent) -> None:
        """Move `entry` by `event` per the table, or InvalidTransition with
        nothing changed."""
        entry.state = next_disk_state(entry, entry.state, event, entry.pins)

    def _evict(self, victim: DiskEntry, reason: str) -> None:
        """Remove an entry just taken off the policy's list."""
        self._apply(victim, DiskEvent.EVICT)
        self.evictable_bytes -= victim.nbytes
        self._remove(victim, reason, True)

    def _link(self, entry: DiskEntry) -> None:
        self._policy.add(entry)
        self.evictable_bytes += entry.nbytes

    def _unlink(self, entry: DiskEntry) -> None:
        self._policy.remove(entry)
        self.evictable_bytes -= entry.nbytes

    def _remove(self, entry: DiskEntry, reason: str, was_stored: bool) -> None:
        del self.entries[entry.where]
        self.used_bytes -= entry.nbytes
        self.evictions[reason] += 1
        if was_stored and self.events is not None:
            self.events.removed(*entry.where)

    def check_invariants(self) -> None:
        for where, e in self.entries.items():
            if e.where != where or e.state is DiskState.ABSENT:
                raise InvariantViolation(f"disk: entry {e.label()} is {e.state.value} under "
                                         f"{where[1].hex()[:16]}")
            if e.pins < 0 or (e.pins and e.state is not DiskState.STORED):
                raise InvariantViolation(f"disk: entry {e.label()} is {e.state.value} "
                                         f"with {e.pins} pins")
        used = sum(e.nbytes for e in self.entries.values())
        if used != self.used_bytes or used > self.capacity_bytes:
            raise InvariantViolation(f"disk: used {self.used_bytes}, entries hold {used}")
        linked = self.eviction_order()
        expect = [e for e in self.entries.values() if e.state is DiskState.STORED and e.pins == 0]
        if {id(e) for e in linked} != {id(e) for e in expect} or len(linked) != len(expect):
            raise InvariantViolation("disk: the policy differs from the unpinned stored entries")
        if sum(e.nbytes for e in linked) != self.evictable_bytes:
            raise InvariantViolation("disk: evictable bytes disagree with the policy")
