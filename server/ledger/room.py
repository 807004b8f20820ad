"""The one eviction loop, shared by every tier's book (pages or bytes).

A book checks first that free + evictable units cover what it needs (and
refuses with nothing changed otherwise); then this loop takes the policy's
victims, in the policy's order, until the room is there. Each book says
what evicting one victim frees, in its own unit.
"""
from __future__ import annotations

from typing import Any, Callable

from ..errors import InvariantViolation
from .policy import EvictionPolicy

# Why a block left a tier: the label values of kvkeeper_evictions_total.
#   capacity             evicted to make room; no lower tier holds a copy
#   demoted              evicted to make room; a lower tier holds a copy, so it moved down
#   admin                an operator's Evict
#   discarded            a client released it with discard
#   aborted              never committed: its writer aborted the save
#   reservation_timeout  never committed: its writer did not commit in time
#   corrupt, lost        a tier found its copy damaged or gone
EVICTION_REASONS: tuple[str, ...] = (
    "capacity", "admin", "discarded", "aborted", "reservation_timeout", "demoted", "corrupt", "lost",
)
# The reasons that are pressure on capacity (what an eviction storm counts).
ROOM_REASONS: tuple[str, ...] = ("capacity", "demoted")


def make_room(policy: EvictionPolicy, free: int, needed: int,
              evict: Callable[[Any], int], tier: str) -> None:
    """Evict `policy`'s victims until `needed` units are free; `evict(victim)`
    drops one from its book and returns the units it freed."""
    while free < needed:
        victim = policy.pop()
        if victim is None:
            raise InvariantViolation(f"{tier}: room for {needed} units was counted but no "
                                     f"victim is left at {free} free")
        free += evict(victim)
