"""Read-only views of every tier's book, in one shape whatever the tier's unit:
what Stats, the metrics, the admin service and the eviction-storm watch read.

Safe from the metrics thread while the loop changes the ledger: only scalar
attributes, len() and dict.get() of fixed keys are read, never an iteration
of a dict the loop may grow (ledger.tiers and ledger.lower are built before
serving and never change).
"""
from __future__ import annotations

from collections import defaultdict
from typing import TYPE_CHECKING

from ..ids import NamespaceId, TierName
from .disk_index import DiskIndex
from .results import Copy, Holding, TierStats
from .room import EVICTION_REASONS
from .tier import Tier

if TYPE_CHECKING:  # pragma: no cover
    from .ledger import Ledger


def _evictions(counter: "dict[str, int]") -> dict[str, int]:
    return {r: counter.get(r, 0) for r in EVICTION_REASONS}


def page_tier_stats(t: Tier) -> TierStats:
    # Each counter read once: bytes and pages of one scrape agree.
    pb, cap, used = t.page_bytes, t.capacity_pages, t.used_pages
    return TierStats(
        name=t.name, capacity_bytes=cap * pb, used_bytes=used * pb,
        evictable_bytes=t.evictable_pages * pb, blocks=t.blocks, pending_blocks=t.pending_blocks,
        evictions=_evictions(t.evictions), hit_blocks=t.hit_blocks, hit_tokens=t.hit_tokens,
        saved_blocks=t.committed_blocks, saved_bytes=t.committed_bytes, page_bytes=pb,
        capacity_pages=cap, used_pages=used, admission_refused=t.admission_refused,
        last_turn_demoted=t.last_turn_demoted)


def byte_tier_stats(led: "Ledger", name: TierName, book: DiskIndex) -> TierStats:
    return TierStats(
        name=name, capacity_bytes=book.capacity_bytes, used_bytes=book.used_bytes,
        evictable_bytes=book.evictable_bytes, blocks=len(book), pending_blocks=0,
        evictions=_evictions(book.evictions), hit_blocks=book.hit_blocks,
        hit_tokens=led.usage.lower_hit_tokens.get(name, 0), saved_blocks=book.written_blocks,
        saved_bytes=book.written_bytes, admission_refused=book.refused,
        last_turn_demoted=book.last_turn_demoted)


def tier_stats(led: "Ledger") -> list[TierStats]:
    """Every tier's book, in lookup order."""
    return ([page_tier_stats(t) for t in led.tiers.values()]
            + [byte_tier_stats(led, name, book) for name, book in led.lower.items()])


def holdings(led: "Ledger") -> dict[NamespaceId, list[Holding]]:
    """What each tier holds of each namespace, in lookup order: the registered
    namespaces, then those only lower tiers hold (no session named them since
    start-up). O(blocks of the lower tiers): for admin calls."""
    below: dict[TierName, dict[bytes, list[int]]] = {}
    for name, book in led.lower.items():
        counts: dict[bytes, list[int]] = defaultdict(lambda: [0, 0])
        for e in book:
            c = counts[e.where[0]]
            c[0] += 1
            c[1] += e.nbytes
        below[name] = counts
    out: dict[NamespaceId, list[Holding]] = {}
    for ns in led.namespaces.values():
        out[ns.id] = [Holding(led.top.name, len(ns.blocks), ns.used_pages * led.top.page_bytes)]
    for name, counts in below.items():
        for ns_id in led.namespaces:
            blocks, nbytes = counts.pop(ns_id, (0, 0))
            out[ns_id].append(Holding(name, blocks, nbytes))
    for name, counts in below.items():
        for ns_raw, (blocks, nbytes) in counts.items():
            out.setdefault(NamespaceId(ns_raw), []).append(Holding(name, blocks, nbytes))
    return out


def copies(led: "Ledger", ns_id: NamespaceId, key: bytes, now: float) -> list[Copy]:
    """Every tier's copy of one block, in lookup order."""
    out: list[Copy] = []
    b = led.block(ns_id, key)
    if b is not None:
        out.append(Copy(b.tier.name, b.state.value, b.refs, b.hits,
                        max(0.0, now - b.last_used), b.ns.block_bytes))
    for name, book in led.lower.items():
        e = book.entries.get((ns_id, key))
        if e is not None:
            # The book keeps no time of use; hits as the host counts them neither.
            out.append(Copy(name, e.state, e.pins, 0, -1.0, e.nbytes))
    return out
