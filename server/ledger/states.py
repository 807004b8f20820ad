"""Lifecycles as transition tables: the ledger's blocks, and (below) the disk
tier's entries. next_state and next_disk_state step through them.

Block lifecycle:

    (state, event)                 -> next state
    (ABSENT,    RESERVE)           -> PENDING     capacity taken, invisible to Match
    (PENDING,   COMMIT)            -> COMMITTED   visible to Match, evictable at 0 refs
    (PENDING,   ABORT)             -> RECLAIMED   writer gave up
    (PENDING,   TIMEOUT)           -> RECLAIMED   writer never committed
    (COMMITTED, PIN)               -> COMMITTED   a lease took a reference
    (COMMITTED, UNPIN)             -> COMMITTED   a lease dropped its reference
    (COMMITTED, EVICT)             -> EVICTED     capacity pressure, only at 0 refs
    (COMMITTED, RECLAIM)           -> RECLAIMED   discarded on purpose, only at 0 refs

EVICTED and RECLAIMED are terminal: the block leaves the ledger.
"""
from __future__ import annotations

import enum
from typing import Generic, TypeVar

from ..errors import InvalidTransition


class BlockState(enum.Enum):
    # Enum.__hash__ is a Python-level function; identity hashing is the same
    # set of values and makes the table lookup on every transition cheaper.
    __hash__ = object.__hash__

    ABSENT = "absent"
    PENDING = "pending-write"
    COMMITTED = "committed"
    EVICTED = "evicted"
    RECLAIMED = "reclaimed"


class Event(enum.Enum):
    __hash__ = object.__hash__

    RESERVE = "reserve"
    COMMIT = "commit"
    ABORT = "abort"
    TIMEOUT = "timeout"
    PIN = "pin"
    UNPIN = "unpin"
    EVICT = "evict"
    RECLAIM = "reclaim"


S, E = BlockState, Event

TRANSITIONS: dict[tuple[BlockState, Event], BlockState] = {
    (S.ABSENT, E.RESERVE): S.PENDING,
    (S.PENDING, E.COMMIT): S.COMMITTED,
    (S.PENDING, E.ABORT): S.RECLAIMED,
    (S.PENDING, E.TIMEOUT): S.RECLAIMED,
    (S.COMMITTED, E.PIN): S.COMMITTED,
    (S.COMMITTED, E.UNPIN): S.COMMITTED,
    (S.COMMITTED, E.EVICT): S.EVICTED,
    (S.COMMITTED, E.RECLAIM): S.RECLAIMED,
}

# Events that may only happen to a block nobody references.
REQUIRES_UNREFERENCED = frozenset({E.EVICT, E.RECLAIM})


# ---------------------------------------------------------------- disk entries
#
# A disk tier entry (ledger/disk_index.py) is keyed by (namespace, key), not
# by a ledger block: its copy outlives the arena copy and the daemon.
#
#     (state,   event)     -> next      notes
#     (ABSENT,  RESERVE)   -> WRITING   bytes taken, invisible to lookups
#     (WRITING, WRITTEN)   -> STORED    visible to lookups, evictable when unpinned
#     (WRITING, FAILED)    -> ABSENT    bytes given back
#     (ABSENT,  ADOPT)     -> STORED    found on disk (recovery, another daemon's write)
#     (STORED,  PIN)       -> STORED    a promotion is reading the file
#     (STORED,  UNPIN)     -> STORED    the read is done
#     (ABSENT,  UNPIN)     -> ABSENT    the read is done; the entry was dropped meanwhile
#     (STORED,  EVICT)     -> ABSENT    only unpinned; the caller deletes the file
#     (STORED,  DROP)      -> ABSENT    the file is gone or corrupt (pinned or not)
#
# ABSENT is where an entry starts and ends: a new DiskEntry object is made for
# each copy, so an entry that went back to ABSENT stays there.


class DiskState(str, enum.Enum):
    # str-valued because the state is shown as is (admin's InspectBlock copy
    # state is this string: "writing" or "stored").
    ABSENT = "absent"
    WRITING = "writing"
    STORED = "stored"


class DiskEvent(enum.Enum):
    __hash__ = object.__hash__

    RESERVE = "reserve"
    WRITTEN = "written"
    FAILED = "failed"
    ADOPT = "adopt"
    PIN = "pin"
    UNPIN = "unpin"
    EVICT = "evict"
    DROP = "drop"


DS, DE = DiskState, DiskEvent

DISK_TRANSITIONS: dict[tuple[DiskState, DiskEvent], DiskState] = {
    (DS.ABSENT, DE.RESERVE): DS.WRITING,
    (DS.WRITING, DE.WRITTEN): DS.STORED,
    (DS.WRITING, DE.FAILED): DS.ABSENT,
    (DS.ABSENT, DE.ADOPT): DS.STORED,
    (DS.STORED, DE.PIN): DS.STORED,
    (DS.STORED, DE.UNPIN): DS.STORED,
    (DS.ABSENT, DE.UNPIN): DS.ABSENT,
    (DS.STORED, DE.EVICT): DS.ABSENT,
    (DS.STORED, DE.DROP): DS.ABSENT,
}

# Events that may only happen to an entry nobody pins.
DISK_REQUIRES_UNPINNED = frozenset({DE.EVICT})


# ---------------------------------------------------------------- the step


def _name(thing: object) -> str:
    """A block's or entry's name for an error: formatted only when an error is raised."""
    if isinstance(thing, (bytes, bytearray)):
        return bytes(thing).hex()[:16]
    label = getattr(thing, "label", None)
    return label() if callable(label) else str(thing)


St = TypeVar("St", bound=enum.Enum)
Ev = TypeVar("Ev", bound=enum.Enum)


class Lifecycle(Generic[St, Ev]):
    """A transition table with its count rule: the events allowed only at a
    zero count (refs, pins), and the event that decrements the count."""

    __slots__ = ("table", "needs_zero", "decrement", "count", "needs_zero_hint", "negative_hint")

    def __init__(self, table: dict[tuple[St, Ev], St], needs_zero: frozenset[Ev],
                 decrement: Ev, count: str, needs_zero_hint: str, negative_hint: str) -> None:
        self.table = table
        self.needs_zero = needs_zero
        self.decrement = decrement
        self.count = count
        self.needs_zero_hint = needs_zero_hint
        self.negative_hint = negative_hint

    def next(self, thing: object, state: St, event: Ev, count: int = 0) -> St:
        """The state after `event`, or InvalidTransition naming thing, state and event.

        `thing` is a name, a key, or an object with label(): the hot path passes
        the object so that no string is built unless the transition is refused."""
        try:
            target = self.table[(state, event)]
        except KeyError:
            raise InvalidTransition(_name(thing), state.value, event.value) from None
        if count and event in self.needs_zero:
            raise InvalidTransition(_name(thing), f"{state.value} ({self.count}={count})",
                                    event.value, self.needs_zero_hint)
        if count <= 0 and event is self.decrement:
            raise InvalidTransition(_name(thing), f"{state.value} ({self.count}=0)", event.value,
                                    self.negative_hint)
        return target


# next_state(block, state, event, refs=0) -> BlockState
next_state = Lifecycle[BlockState, Event](TRANSITIONS, REQUIRES_UNREFERENCED, E.UNPIN, "refs",
                       "only unreferenced blocks can be evicted or reclaimed",
                       "a reference count never goes negative").next

# next_disk_state(entry, state, event, pins=0) -> DiskState
next_disk_state = Lifecycle[DiskState, DiskEvent](DISK_TRANSITIONS, DISK_REQUIRES_UNPINNED, DE.UNPIN, "pins",
                            "only unpinned entries can be evicted",
                            "a pin count never goes negative").next
