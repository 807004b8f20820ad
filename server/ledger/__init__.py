"""Sans-I/O block ledger: namespaces, blocks, leases, reservations, and the book
of every tier (pages for the host arena, bytes for the tiers below).

    ledger.py      the Ledger: sessions, match, leases, expiry, admin reclaim
    saves.py       reserve / record_write / commit / abort (part of the Ledger)
    lower.py       the lower tiers' books, the daemon's own pins (part of the Ledger)
    tier.py        a page tier's book; disk_index.py a byte tier's book
    room.py        the one eviction loop and the eviction reasons
    policy.py      the eviction policies by name (recency.py, s3fifo.py)
    chains.py      chain order over any policy: leaves first, stranded first
    books.py       a block's pins, eviction and removal in its page tier
    views.py       every book in one shape (Stats, metrics, admin)
    invariants.py  what must hold between calls
"""
from .ledger import Ledger, LedgerConfig
from .pages import page_runs
from .records import Block, Internal, Lease, Namespace, NamespaceDescriptor
from .results import (Copy, ExpiryReport, Holding, Located, MatchResult, ReserveResult,
                      SlotStatus, TierStats)
from .room import EVICTION_REASONS, ROOM_REASONS
from .states import BlockState, Event
from .tier import Tier, TierSpec
from .usage import LookupReport, Usage

__all__ = ["Block", "BlockState", "Copy", "EVICTION_REASONS", "Event", "ExpiryReport", "Holding",
           "Internal", "Lease", "Ledger", "LedgerConfig", "Located", "LookupReport",
           "MatchResult", "Namespace", "NamespaceDescriptor", "ROOM_REASONS", "ReserveResult",
           "SlotStatus", "Tier", "TierSpec", "TierStats", "Usage", "page_runs"]
