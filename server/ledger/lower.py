"""The books of the tiers below the page tiers, and the daemon's own work.

A part of the Ledger (a mixin, see ledger.py). A lower tier (the disk) keeps
copies of blocks in bytes, keyed by (namespace id, key), because a copy
outlives the top tier's block, the session that wrote it and the daemon
(see disk_index.py). The ledger keeps those books with the configured
eviction policy; the tier stack asks here where a lookup's blocks are, what
admission lets down, and pins blocks for its flushes on the internal holder.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Optional, Sequence

from ..ids import TierName
from .disk_index import DiskIndex
from .events import TierEvents
from .records import Block, Lease, Namespace
from .results import Located
from .states import BlockState

if TYPE_CHECKING:  # pragma: no cover
    from .ledger import Ledger

COMMITTED = BlockState.COMMITTED


class LowerBooks:
    """Ledger methods for the tiers below (see the module docstring)."""

    def add_book(self: "Ledger", name: TierName, capacity_bytes: int) -> DiskIndex:
        """Keep the book of a lower tier of `capacity_bytes`, looked up after
        the tiers added before it."""
        if name in self.tiers or name in self.lower:
            raise ValueError(f"the ledger keeps a book of tier {name} already")
        book = DiskIndex(capacity_bytes, self.config.policy)
        book.events = TierEvents(self.residency.log, name)
        self.lower[name] = book
        return book

    def locate(self: "Ledger", ns: Namespace, keys: Sequence[bytes], start: int = 0) -> Located:
        """Which tier holds each leading key from `start` on, until the first
        key no tier holds (the keys are checked already)."""
        tiers: list[TierName] = []
        for k in keys[start:]:
            b = ns.blocks.get(k)  # type: ignore[call-overload]
            if b is not None:
                if b.state is not COMMITTED:
                    return Located(tiers, probe=False)   # being written: not yet anywhere
                tiers.append(b.tier.name)
                continue
            for name, book in self.lower.items():
                if book.get(ns.id, k) is not None:
                    tiers.append(name)
                    break
            else:
                return Located(tiers, probe=True)
        return Located(tiers, probe=False)

    def adopt(self: "Ledger", tier: TierName, ns: Namespace, key: bytes, nbytes: int) -> bool:
        """Record a copy that tier's medium holds though its book did not (another
        daemon wrote it); False when it is not of the namespace's block size or
        does not fit."""
        if nbytes != ns.block_bytes:
            return False
        return self.lower[tier].adopt(ns.id, key, nbytes) is not None

    def touch(self: "Ledger", tier: TierName, ns: Namespace, key: bytes) -> None:
        """A lower tier's copy was hit without being promoted."""
        book = self.lower[tier]
        e = book.get(ns.id, key)
        if e is not None:
            book.touch(e)

    def demote_lower(self: "Ledger", ns: Namespace, key: bytes) -> None:
        """A last turn demoted the top tier's block: the lower tiers' copies go
        first in line too, so the disk does not keep what nobody reads again."""
        for book in self.lower.values():
            e = book.get(ns.id, key)
            if e is not None:
                book.demote(e)

    def due_for_admission(self: "Ledger", tier: TierName, ns: Namespace,
                          keys: Sequence[bytes], hits: int) -> list[bytes]:
        """The keys whose top-tier block reached `hits` hits and that `tier`
        neither holds nor is writing yet (the keys are committed blocks of `ns`)."""
        entries = self.lower[tier].entries
        return [k for k in keys if ns.blocks[k].hits >= hits  # type: ignore[index]
                and (ns.id, k) not in entries]

    def eviction_reason(self: "Ledger", b: Block) -> str:
        """Why a victim of capacity pressure leaves: demoted when a lower tier
        keeps its copy, so the block moved down rather than being lost."""
        for book in self.lower.values():
            if book.get(b.ns.id, b.key) is not None:
                return "demoted"
        return "capacity"

    # ------------------------------------------------------------ the daemon's own pins
    def pin_internal(self: "Ledger", ns: Namespace, keys: Sequence[bytes]) -> Optional[Lease]:
        """Pin the leading committed blocks of `keys` for the daemon's own work
        (flushing them to a lower tier): no lookup, no hit, no session. None
        when the first key is no committed block."""
        hit: list[Block] = []
        for k in keys:
            b = ns.blocks.get(k)  # type: ignore[call-overload]
            if b is None or b.state is not COMMITTED:
                break
            hit.append(b)
        return self._new_lease(self.internal, hit) if hit else None

    def release_internal(self: "Ledger", lease: Lease, now: float) -> None:
        """Drop an internal lease (again is a no-op)."""
        if self.leases.get(lease.id) is lease and lease.session is self.internal:
            self._release(lease, discard=(), now=now)
