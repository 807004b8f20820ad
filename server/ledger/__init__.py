"""Sans-I/O block ledger: namespaces, blocks, leases, reservations and capacity."""
from .ledger import ExpiryReport, Ledger, LedgerConfig, MatchResult, ReserveResult, SlotStatus
from .pages import page_runs
from .records import Block, Lease, Namespace, NamespaceDescriptor
from .states import BlockState, Event
from .tier import Tier, TierSpec
from .usage import LookupReport, Usage

__all__ = ["Block", "BlockState", "Event", "ExpiryReport", "Lease", "Ledger", "LedgerConfig",
           "LookupReport", "MatchResult", "Namespace", "NamespaceDescriptor", "ReserveResult",
           "SlotStatus", "Tier", "TierSpec", "Usage", "page_runs"]
