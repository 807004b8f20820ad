"""A block's moves within its page tier's book: pins, eviction, removal.

The ledger's calls (sessions', leases', saves', the daemon's own) all go
through these, so the tier's counters and its policy stay in step with the
block's state and references.
"""
from __future__ import annotations

from typing import Optional

from .chains import unlink
from .records import Block
from .states import BlockState, Event, next_state
from .tier import Tier


def pin(b: Block) -> None:
    next_state(b, b.state, Event.PIN, b.refs)
    if b.refs == 0:
        b.tier.policy.remove(b)
        b.tier.evictable_pages -= b.ns.pages_per_block
    b.refs += 1


def unpin(b: Block, now: float) -> None:
    next_state(b, b.state, Event.UNPIN, b.refs)
    b.refs -= 1
    b.last_used = now
    if b.refs == 0:
        b.tier.policy.add(b)
        b.tier.evictable_pages += b.ns.pages_per_block


def demote(b: Block) -> bool:
    """A client said nobody reads `b` again soon (a conversation's last turn
    read it): its policy evicts it first unless it is hit again. Only an
    evictable block: one another lease pins keeps its place (that reader
    reads it), and a pending one was never read. Whether it was demoted."""
    if b.refs == 0 and b.state is BlockState.COMMITTED:
        b.tier.policy.demote(b)
        b.tier.last_turn_demoted += 1
        return True
    return False


def reclaim(b: Block, reason: str) -> None:
    """Drop an unreferenced committed block on purpose (discard, admin)."""
    b.tier.policy.remove(b)
    b.tier.evictable_pages -= b.ns.pages_per_block
    drop(b, Event.RECLAIM, reason)


def evict(b: Block, reason: str) -> int:
    """Drop a victim the policy already unlinked; returns the pages it freed."""
    b.tier.evictable_pages -= b.ns.pages_per_block
    drop(b, Event.EVICT, reason)
    return b.ns.pages_per_block


def drop(b: Block, event: Event, reason: str, cool_until: Optional[float] = None) -> None:
    """Remove `b` from the ledger and free its pages, or with `cool_until` keep
    them out of use till then (cooling.py). It is already unlinked."""
    was = b.state
    b.state = next_state(b, was, event, b.refs)
    tier: Tier = b.tier
    if tier.events is not None and was is BlockState.COMMITTED:
        tier.events.removed(b.ns.id, b.key)
    if cool_until is None:
        tier.pages.free(b.pages, b.ns.pages_per_block)
    else:
        tier.cooling.add(b.pages, b.ns.pages_per_block, cool_until)
    b.ns.used_pages -= b.ns.pages_per_block
    tier.blocks -= 1
    tier.evictions[reason] += 1
    del b.ns.blocks[b.key]
    unlink(b)   # its parent loses a child; its subtree, if any, is stranded
