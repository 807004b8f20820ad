"""What must hold between ledger calls: check_ledger() recounts every book.

O(blocks): for tests, fuzzing and audits, never on a request path.
"""
from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING, NoReturn

from ..errors import InvariantViolation
from .chains import DUE, GONE, PARKED, PLACE, STRANDED, children, stranded
from .pages import iter_pages
from .states import BlockState
from .tier import Tier

if TYPE_CHECKING:  # pragma: no cover
    from .ledger import Ledger

S = BlockState


def _bad(msg: str) -> NoReturn:
    raise InvariantViolation(msg)


def check_ledger(led: "Ledger") -> None:
    """Raise InvariantViolation unless the books balance."""
    lease_refs: dict[int, int] = {}
    for lease in led.leases.values():
        holder = lease.session
        live = holder is led.internal or holder.id in led.sessions
        if lease.id not in holder.leases or not live:
            _bad(f"lease {lease.id} is not owned by a live session or the daemon")
        for b in lease.blocks:
            if b.state is not S.COMMITTED:
                _bad(f"lease {lease.id} holds {b.label()} in state {b.state.value}")
            lease_refs[id(b)] = lease_refs.get(id(b), 0) + 1
    pending_ids = {id(b) for r in led.reservations.values() for b in r.blocks}
    for ns in led.namespaces.values():
        if ns.used_pages != len(ns.blocks) * ns.pages_per_block:
            _bad(f"namespace {ns.id.hex()[:8]} counts {ns.used_pages} pages but its "
                 f"{len(ns.blocks)} blocks hold {len(ns.blocks) * ns.pages_per_block}")
    for tier in led.tiers.values():
        _check_tier(led, tier, lease_refs, pending_ids)
    for holder in [*led.sessions.values(), led.internal]:
        for lid in holder.leases:
            if led.leases.get(lid) is None or led.leases[lid].session is not holder:
                _bad(f"session {holder.id} lists lease {lid} it does not hold")
        for rid in holder.reservations:
            if led.reservations.get(rid) is None or led.reservations[rid].session is not holder:
                _bad(f"session {holder.id} lists reservation {rid} it does not hold")
    for session in led.sessions.values():
        if any(w.session is not session or not w.open for w in session.watches):
            _bad(f"session {session.id} lists a watch that is closed or another session's")
    owners = Counter(s.owner for s in led.sessions.values())
    if owners != led.session_table.per_owner:
        _bad(f"sessions per identity counted {dict(led.session_table.per_owner)}, "
             f"live {dict(owners)}")
    for book in led.lower.values():
        book.check_invariants()
    for ns in led.namespaces.values():
        _check_chains(ns)
    problems = led.residency.check_invariants(led.sessions)
    if problems:
        _bad("; ".join(problems))


def _check_chains(ns) -> None:  # type: ignore[no-untyped-def]
    """Links both ways, stranded marks, and where the policy holds a block:
    no stranded block is evictable anywhere but first (due), no parked one
    without a cached child."""
    for b in ns.blocks.values():
        p = b.parent
        if p is not None and p is not GONE:
            if ns.blocks.get(p.key) is not p:
                _bad(f"{b.label()} links to a parent that left the ledger")
            if b is not p.child and b not in ns.more_kids.get(p, ()):
                _bad(f"{b.label()} is not among its parent's children")
        for c in children(b):
            if c.parent is not b or ns.blocks.get(c.key) is not c:
                _bad(f"{b.label()} lists a child {c.label()} that is not its own or left")
        if bool(b.pq & STRANDED) != stranded(b):
            _bad(f"{b.label()}: stranded mark {bool(b.pq & STRANDED)}, chain says {stranded(b)}")
        place = b.pq & PLACE
        evictable = b.state is S.COMMITTED and b.refs == 0
        if evictable != bool(place):
            _bad(f"{b.label()}: evictable={evictable} but policy place {place:#x}")
        if evictable and b.pq & STRANDED and place != DUE:
            _bad(f"{b.label()} is stranded (its parent is gone) yet not evicted first")
        if place == PARKED and b.child is None:
            _bad(f"{b.label()} is parked without a cached child")
        if place == DUE and not b.pq & STRANDED and b.child is not None:
            _bad(f"{b.label()} is due for eviction before its cached child")
    for p, more in ns.more_kids.items():
        if not more or ns.blocks.get(p.key) is not p:
            _bad(f"namespace {ns.id.hex()[:8]}: children kept for a block that left or has none")


def _check_tier(led: "Ledger", tier: Tier, lease_refs: dict[int, int],
                pending_ids: set[int]) -> None:
    owned: set[int] = set()
    used = evictable = blocks = pending = 0
    for ns in led.namespaces.values():
        for key, b in ns.blocks.items():
            if b.tier is not tier:
                continue
            if b.key != key or b.ns is not ns:
                _bad(f"{b.label()} is filed under the wrong key or namespace")
            blocks += 1
            n = ns.pages_per_block
            pages = set(iter_pages(b.pages, n))
            if len(pages) != n or pages & owned:
                _bad(f"{b.label()} shares pages with another block")
            owned |= pages
            used += n
            if b.refs != lease_refs.get(id(b), 0) or b.refs < 0:
                _bad(f"{b.label()} has refs={b.refs} but {lease_refs.get(id(b), 0)} lease refs")
            if b.state is S.PENDING:
                pending += 1
                if id(b) not in pending_ids:
                    _bad(f"{b.label()} is pending without a reservation")
            elif b.state is S.COMMITTED:
                if b.refs == 0:
                    evictable += n
            else:
                _bad(f"{b.label()} is in terminal state {b.state.value} but still filed")
    if used + tier.cooling.pages != tier.used_pages:
        _bad(f"{tier.name}: blocks hold {used} pages and {tier.cooling.pages} cool, "
             f"allocator says {tier.used_pages}")
    cool = tier.cooling.page_set()
    if len(cool) != tier.cooling.pages or cool & owned:
        _bad(f"{tier.name}: a cooling page is owned by a block, or counted twice")
    if (owned | cool) & tier.pages.free_set():
        _bad(f"{tier.name}: a page is both free and owned")
    if tier.free_pages < 0 or tier.used_pages > tier.capacity_pages:
        _bad(f"{tier.name}: free pages negative")
    if evictable != tier.evictable_pages:
        _bad(f"{tier.name}: evictable pages {tier.evictable_pages}, expected {evictable}")
    in_policy = list(tier.policy)
    if len(in_policy) != len(tier.policy):
        _bad(f"{tier.name}: policy length disagrees with its contents")
    for b in in_policy:
        if b.state is not S.COMMITTED or b.refs != 0:
            _bad(f"{b.label()} is evictable but state={b.state.value} refs={b.refs}")
    if sum(b.ns.pages_per_block for b in in_policy) != evictable:
        _bad(f"{tier.name}: policy holds a different set than the unreferenced committed blocks")
    if blocks != tier.blocks or pending != tier.pending_blocks:
        _bad(f"{tier.name}: block counters {tier.blocks}/{tier.pending_blocks}, "
             f"expected {blocks}/{pending}")
