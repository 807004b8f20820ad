"""Sans-I/O block ledger: namespaces, blocks, leases, reservations and capacity."""
from .ledger import ExpiryReport, Ledger, LedgerConfig, MatchResult, ReserveResult, SlotStatus
from .pages import page_runs
from .records import Block, Namespace, NamespaceDescriptor
from .states import BlockState, Event
from .tier import Tier, TierSpec

__all__ = ["Block", "BlockState", "Event", "ExpiryReport", "Ledger", "LedgerConfig", "MatchResult",
           "Namespace", "NamespaceDescriptor", "ReserveResult", "SlotStatus", "Tier", "TierSpec",
           "page_runs"]
