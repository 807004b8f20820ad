"""Block lifecycle as a transition table.

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


def _name(block: object) -> str:
    """A block's name for an error: formatted only when an error is raised."""
    if isinstance(block, (bytes, bytearray)):
        return bytes(block).hex()[:16]
    label = getattr(block, "label", None)
    return label() if callable(label) else str(block)


def next_state(block: object, state: BlockState, event: Event, refs: int = 0) -> BlockState:
    """The state after `event`, or InvalidTransition naming block, state and event.

    `block` is a name, a key, or an object with label(): the hot path passes
    the object so that no string is built unless the transition is refused."""
    try:
        target = TRANSITIONS[(state, event)]
    except KeyError:
        raise InvalidTransition(_name(block), state.value, event.value) from None
    if refs and event in REQUIRES_UNREFERENCED:
        raise InvalidTransition(
            _name(block), f"{state.value} (refs={refs})", event.value,
            "only unreferenced blocks can be evicted or reclaimed",
        )
    if refs <= 0 and event is E.UNPIN:
        raise InvalidTransition(_name(block), f"{state.value} (refs=0)", event.value,
                                "a reference count never goes negative")
    return target
