"""What the disk tier holds: a pure, synchronous index (no I/O, like the ledger).

The disk tier keeps a copy of blocks below the host arena. Its entries are
keyed by (namespace digest, key) rather than by ledger blocks because a disk
copy outlives the arena copy, the session that wrote it and the daemon
process: after a restart the index is rebuilt from the directory before any
namespace is registered again.

    (state,   event)      -> next       notes
    (absent,  reserve)    -> writing    bytes taken atomically, or ResourceExhausted
    (writing, written)    -> stored     visible to lookups, evictable when unpinned
    (writing, failed)     -> absent     bytes given back
    (absent,  adopt)      -> stored     found on disk (recovery, another daemon's write)
    (stored,  pin/unpin)  -> stored     a promotion is reading the file
    (stored,  evict)      -> absent     the policy's victim among unpinned entries; the caller
                                        deletes the file
    (stored,  drop)       -> absent     the file is gone or corrupt

Eviction takes the configured policy's victims (policy.py, as the host tier)
through the one eviction loop (room.py).
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterator, Optional

from ..errors import InvalidTransition, InvariantViolation, ResourceExhausted
from .policy import make_policy
from .room import make_room

WRITING = "writing"
STORED = "stored"

Where = tuple[bytes, bytes]  # (namespace digest, key)


class DiskEntry:
    __slots__ = ("where", "nbytes", "state", "pins", "hits", "prev", "next")

    def __init__(self, where: Where, nbytes: int, state: str) -> None:
        self.where = where
        self.nbytes = nbytes
        self.state = state
        self.pins = 0
        self.hits = 0   # what the hits-lru policy orders by
        self.prev: Optional[DiskEntry] = None
        self.next: Optional[DiskEntry] = None

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

    def __len__(self) -> int:
        return len(self.entries)

    def get(self, ns: bytes, key: bytes) -> Optional[DiskEntry]:
        """The stored entry for (ns, key), or None (writing counts as absent)."""
        e = self.entries.get((ns, key))
        return e if e is not None and e.state == STORED else None

    def reserve(self, ns: bytes, key: bytes, nbytes: int) -> Optional[Reservation]:
        """Take `nbytes` for a new copy, evicting unpinned entries if needed.

        None when a copy exists or is being written already. ResourceExhausted,
        with nothing changed, when even evicting every unpinned entry would not
        make room.
        """
        where = (ns, key)
        if where in self.entries:
            return None
        free = self.capacity_bytes - self.used_bytes
        if nbytes > free + self.evictable_bytes:
            raise ResourceExhausted(
                f"disk tier: a block of {nbytes} B does not fit ({free} B free, "
                f"{self.evictable_bytes} B evictable of {self.capacity_bytes} B); "
                "raise disk_tier.capacity_bytes or free space")
        evicted: list[Where] = []

        def evict(victim: DiskEntry) -> int:
            self.evictable_bytes -= victim.nbytes
            self._remove(victim, "capacity")
            evicted.append(victim.where)
            return victim.nbytes

        make_room(self._policy, free, nbytes, evict, "disk tier")
        entry = DiskEntry(where, nbytes, WRITING)
        self.entries[where] = entry
        self.used_bytes += nbytes
        return Reservation(entry, evicted)

    def written(self, entry: DiskEntry) -> None:
        self._expect(entry, WRITING, "written")
        entry.state = STORED
        self.written_blocks += 1
        self.written_bytes += entry.nbytes
        self._link(entry)

    def failed(self, entry: DiskEntry) -> None:
        self._expect(entry, WRITING, "failed")
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
        entry = DiskEntry(where, nbytes, STORED)
        self.entries[where] = entry
        self.used_bytes += nbytes
        self._link(entry)
        return entry

    def pin(self, entry: DiskEntry) -> None:
        self._expect(entry, STORED, "pin")
        if entry.pins == 0:
            self._unlink(entry)
        entry.pins += 1

    def unpin(self, entry: DiskEntry) -> None:
        if entry.pins <= 0:
            raise InvalidTransition(entry.label(), f"{entry.state} (pins=0)", "unpin",
                                    "a pin count never goes negative")
        entry.pins -= 1
        if entry.pins == 0 and entry.state == STORED and self.entries.get(entry.where) is entry:
            self._link(entry)

    def touch(self, entry: DiskEntry) -> None:
        """A hit: the entry becomes the most recently used."""
        self.hit_blocks += 1
        if entry.pins == 0 and entry.state == STORED:
            self._policy.hit(entry)
        else:
            entry.hits += 1

    def drop(self, entry: DiskEntry, reason: str) -> None:
        """Forget a stored copy whose file is gone or corrupt (pins or not)."""
        if self.entries.get(entry.where) is not entry:
            return
        if entry.pins == 0 and entry.state == STORED:
            self._unlink(entry)
        self._remove(entry, reason)

    def evict_unpinned(self, reason: str = "admin") -> list[Where]:
        out = []
        while True:
            victim = self._policy.pop()
            if victim is None:
                return out
            self.evictable_bytes -= victim.nbytes
            self._remove(victim, reason)
            out.append(victim.where)

    def __iter__(self) -> Iterator[DiskEntry]:
        return iter(list(self.entries.values()))

    # ------------------------------------------------------------ internals
    def _expect(self, entry: DiskEntry, state: str, event: str) -> None:
        if entry.state != state or self.entries.get(entry.where) is not entry:
            raise InvalidTransition(entry.label(), entry.state, event)

    def _link(self, entry: DiskEntry) -> None:
        self._policy.add(entry)
        self.evictable_bytes += entry.nbytes

    def _unlink(self, entry: DiskEntry) -> None:
        self._policy.remove(entry)
        self.evictable_bytes -= entry.nbytes

    def _remove(self, entry: DiskEntry, reason: str) -> None:
        del self.entries[entry.where]
        self.used_bytes -= entry.nbytes
        self.evictions[reason] += 1

    def check_invariants(self) -> None:
        used = sum(e.nbytes for e in self.entries.values())
        if used != self.used_bytes or used > self.capacity_bytes:
            raise InvariantViolation(f"disk: used {self.used_bytes}, entries hold {used}")
        linked = list(self._policy)
        expect = [e for e in self.entries.values() if e.state == STORED and e.pins == 0]
        if {id(e) for e in linked} != {id(e) for e in expect} or len(linked) != len(expect):
            raise InvariantViolation("disk: the policy differs from the unpinned stored entries")
        if sum(e.nbytes for e in linked) != self.evictable_bytes:
            raise InvariantViolation("disk: evictable bytes disagree with the policy")
