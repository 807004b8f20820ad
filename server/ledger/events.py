"""The residency event log: blocks stored, removed and cleared, per tier and
engine, numbered, kept in a bounded replay buffer.

Tiers: "gpu" events come from the engines' reports (residency.py), one per
change and engine; "host" and "disk" events from the daemon's own books
(TierEvents below): a stored event per commit (or disk write), a removed
event per block that leaves (evicted, discarded, dropped), logged once
someone has watched since start-up (`watched`).

What WatchEvents streams (api/residency.py). Every event gets the next
sequence number (1, 2, ...) of this daemon's `epoch` (a random id per start:
a restarted daemon numbers from 1 again, and a watcher resuming with the old
epoch is told everything before was lost). The buffer keeps the newest events
up to `capacity_keys` keys in all (a cleared event counts as one), so a
watcher that reconnects within that window misses nothing; one that asks for
events already dropped gets a Replay whose `lost` names the missing range:
a gap is reported, never hidden.

Sans-I/O: `on_append`, when set, is called after each append (the servicer
wakes its watchers there); it must not raise.
"""
from __future__ import annotations

import secrets
from collections import deque
from dataclasses import dataclass
from itertools import islice
from typing import Callable, Iterable, NamedTuple, Optional

from ..errors import OutOfRange
from ..ids import EngineId, NamespaceId, TierName

STORED, REMOVED, CLEARED = "stored", "removed", "cleared"
EVENT_KINDS: tuple[str, ...] = (STORED, REMOVED, CLEARED)
# The engine of an event of a tier that is not per engine (host, disk).
NO_ENGINE = EngineId("")

# Default bound of the replay buffer, in keys (32 B each): ~8 MiB of keys.
DEFAULT_CAPACITY_KEYS = 1 << 18


class ResidencyEvent(NamedTuple):
    # A tuple, not a dataclass: the host tier logs one per evicted block.
    seq: int
    tier: TierName
    engine: EngineId          # "" for a tier that is not per engine
    kind: str                 # EVENT_KINDS
    namespace: NamespaceId
    keys: tuple[bytes, ...]   # empty for CLEARED

    @property
    def weight(self) -> int:
        """What it takes of the buffer's capacity."""
        return max(1, len(self.keys))


@dataclass(frozen=True)
class Replay:
    """Events after a sequence number, in order; `lost` is the (first, last)
    sequence numbers no longer in the buffer, or None when nothing is missing."""

    events: list[ResidencyEvent]
    lost: Optional[tuple[int, int]]


class EventLog:
    def __init__(self, capacity_keys: int = DEFAULT_CAPACITY_KEYS,
                 epoch: Optional[str] = None) -> None:
        if capacity_keys <= 0:
            raise ValueError("the event log needs room for at least one key")
        self.capacity_keys = capacity_keys
        self.epoch = epoch or secrets.token_hex(8)
        self._buffer: deque[ResidencyEvent] = deque()
        self._weight = 0
        self._next = 1
        # Events dropped from the buffer so far (read by metrics).
        self.dropped = 0
        self.on_append: Optional[Callable[[], None]] = None
        # Whether anyone has watched (WatchEvents) since start-up: until then
        # the daemon's own tiers log nothing (TierEvents), so a daemon nobody
        # watches pays nothing per block saved or evicted.
        self.watched = False

    @property
    def last_seq(self) -> int:
        """The newest sequence number issued (0 before the first event)."""
        return self._next - 1

    @property
    def first_seq(self) -> int:
        """The oldest sequence number still in the buffer (last_seq + 1 when empty)."""
        return self._buffer[0].seq if self._buffer else self._next

    def __len__(self) -> int:
        return len(self._buffer)

    def __iter__(self) -> "Iterable[ResidencyEvent]":
        return iter(list(self._buffer))

    @property
    def weight(self) -> int:
        return self._weight

    def append(self, tier: TierName, engine: EngineId, kind: str, namespace: NamespaceId,
               keys: Iterable[bytes] = ()) -> ResidencyEvent:
        keys = tuple(keys)
        e = ResidencyEvent(self._next, tier, engine, kind, namespace, keys)
        self._next += 1
        buf = self._buffer
        buf.append(e)
        w = self._weight + (len(keys) or 1)   # e.weight, inline: once per evicted block
        if w > self.capacity_keys:
            # The newest event always stays, however large: a watcher must see it.
            cap = self.capacity_keys
            while w > cap and len(buf) > 1:
                w -= len(buf.popleft().keys) or 1
                self.dropped += 1
        self._weight = w
        if self.on_append is not None:
            self.on_append()
        return e

    def since(self, after_seq: int) -> Replay:
        """Every event with a sequence number above `after_seq`. OutOfRange for
        a number this log never issued (a client bug, or another epoch's)."""
        if after_seq < 0 or after_seq > self.last_seq:
            raise OutOfRange(
                f"event {after_seq} was never issued: the newest is {self.last_seq} of epoch "
                f"{self.epoch}; resume with a sequence number this epoch gave you")
        first = self.first_seq
        lost = (after_seq + 1, first - 1) if after_seq + 1 < first else None
        # The newest n events, read from the right end: O(n), not O(buffer), so a
        # live watcher woken for one event reads one.
        n = min(self.last_seq - after_seq, len(self._buffer))
        events = list(islice(reversed(self._buffer), n))
        events.reverse()
        return Replay(events, lost)

    def check_invariants(self) -> list[str]:
        """Problems found (empty when sound): numbering, weight, bound."""
        out: list[str] = []
        seqs = [e.seq for e in self._buffer]
        if seqs and seqs != list(range(seqs[0], seqs[0] + len(seqs))):
            out.append("event log: sequence numbers are not consecutive")
        if seqs and seqs[-1] != self.last_seq:
            out.append(f"event log: newest event {seqs[-1]} but last_seq {self.last_seq}")
        if sum(e.weight for e in self._buffer) != self._weight:
            out.append("event log: weight disagrees with its events")
        if self._weight > self.capacity_keys and len(self._buffer) > 1:
            out.append("event log: over capacity with more than one event")
        # The buffer only ever loses its oldest events, and never its newest.
        if self.first_seq - 1 != self.dropped:
            out.append("event log: dropped count disagrees with the first retained event")
        return out


class TierEvents:
    """The events of one of the daemon's own tiers (host, disk: no engine):
    what the tier's book calls when a block becomes visible there (stored)
    or leaves (removed). Set on the book by the ledger (Tier.events,
    DiskIndex.events); a book without one logs nothing."""

    __slots__ = ("log", "tier")

    def __init__(self, log: EventLog, tier: TierName) -> None:
        self.log = log
        self.tier = tier

    def stored(self, namespace: bytes, keys: "list[bytes]") -> None:
        if keys and self.log.watched:
            self.log.append(self.tier, NO_ENGINE, STORED, NamespaceId(namespace), keys)

    def removed(self, namespace: bytes, key: bytes) -> None:
        if self.log.watched:
            self.log.append(self.tier, NO_ENGINE, REMOVED, NamespaceId(namespace), (key,))
