"""What the ledger's calls answer: plain records, no behaviour."""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from ..ids import LeaseId, ReservationId, SessionId, TierName
from .records import Block


@dataclass(frozen=True)
class MatchResult:
    matched: int
    tiers: list[TierName]
    lease_id: Optional[LeaseId]


class SlotStatus:
    RESERVED = "reserved"
    PRESENT = "present"
    IN_FLIGHT = "in-flight"
    NOT_ADMITTED = "not-admitted"   # the tier's admission turned the new key away


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
    thawed_pages: int = 0   # pages of reservations the daemon ended, free again (cooling.py)


@dataclass(frozen=True)
class Located:
    """Where the leading keys of a lookup are: one tier name per key found,
    in order. `probe` says the next key is in no tier's book nor being
    written, so a tier whose medium others write too (a shared directory)
    may still hold it."""

    tiers: list[TierName]
    probe: bool


@dataclass(frozen=True)
class TierStats:
    """One tier's book as Stats and the metrics report it, in bytes; page
    counts only for tiers kept in pages (0 otherwise)."""

    name: TierName
    capacity_bytes: int
    used_bytes: int
    evictable_bytes: int
    blocks: int
    pending_blocks: int
    evictions: dict[str, int]
    hit_blocks: int
    hit_tokens: int
    saved_blocks: int
    saved_bytes: int
    page_bytes: int = 0
    capacity_pages: int = 0
    used_pages: int = 0
    # New blocks the tier's admission turned away (cold runs, cold disk copies).
    admission_refused: int = 0
    # Blocks a conversation's last turn demoted on release (page tiers).
    last_turn_demoted: int = 0

    @property
    def pinned_bytes(self) -> int:
        # Read field by field while the loop may run; clamp a straddled read.
        return max(0, self.used_bytes - self.evictable_bytes)


@dataclass(frozen=True)
class Holding:
    """What one tier holds of one namespace (admin's ListNamespaces)."""

    tier: TierName
    blocks: int
    bytes: int


@dataclass(frozen=True)
class Copy:
    """One tier's copy of one block (admin's InspectBlock); idle_seconds < 0
    where the tier keeps no time of use."""

    tier: TierName
    state: str
    refs: int
    hits: int
    idle_seconds: float
    bytes: int
