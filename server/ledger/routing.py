"""The ledger's calls about engine residency: reports, and where a chain is.

A part of the Ledger (a mixin, see ledger.py), over `ledger.residency`
(residency.py, the gpu tier's book per engine). These check the session and
the keys as every ledger call does, then read or change the books:

    report_residency  a session's batched changes (ReportResidency)
    locate_chain      per engine the prefix of a key chain it holds, and
                      the prefix each tier of the daemon holds (Locate)
    gpu_holder        the other engine holding the longest prefix (Match)
"""
from __future__ import annotations

from dataclasses import dataclass
from itertools import takewhile
from typing import TYPE_CHECKING, Optional, Sequence

from ..ids import LOCAL, EngineId, Identity, NamespaceId, SessionId, TierName
from .residency import Change, EngineBook, ReportResult
from .states import DiskState

if TYPE_CHECKING:  # pragma: no cover
    from .ledger import Ledger

STORED = DiskState.STORED


@dataclass(frozen=True)
class EnginePrefix:
    engine: EngineId
    instance_id: str
    prefix: int
    resident_blocks: int
    capacity_blocks: int


@dataclass(frozen=True)
class Placement:
    """Where a key chain is: `engines`, every engine reporting in the
    namespace (longest prefix first, then in the order they first reported);
    `tiers`, the leading keys each of the daemon's tiers holds by itself, in
    lookup order; `stored`, the leading keys some tier of the daemon holds
    (a Match's answer, without probing a shared medium for keys no book has)."""

    namespace: NamespaceId
    engines: list[EnginePrefix]
    tiers: list[tuple[TierName, int]]
    stored: int


class RoutingCalls:
    """Ledger methods for the gpu tier's books (see the module docstring)."""

    def report_residency(self: "Ledger", sid: SessionId, changes: Sequence[Change], now: float, *,
                         capacity_blocks: int = 0, report_seq: int = 0,
                         owner: Identity = LOCAL) -> ReportResult:
        session = self.session(sid, now, owner)
        checked = [Change(c.kind, self.check_keys(c.keys, unique=False), list(c.block_ids))
                   for c in changes]
        r = self.residency.report(session, checked, capacity_blocks=capacity_blocks,
                                  report_seq=report_seq, now=now)
        self.renew(session, now)
        return r

    def locate_chain(self: "Ledger", namespace: NamespaceId, keys: Sequence[bytes]) -> Placement:
        """Read-only: no lookup is counted, no block is touched, nothing renews."""
        keys = self.check_keys(keys, unique=False)
        found = [EnginePrefix(b.engine, b.instance_id, n, len(b.blocks), b.capacity_blocks)
                 for b, n in self.residency.prefixes(namespace, keys)]
        found.sort(key=lambda e: -e.prefix)   # stable: ties keep the order of first report
        ns = self.namespaces.get(namespace)
        # Which tier holds each leading key (the page tiers first): a page
        # tier's own prefix is the leading run of its name there.
        where = self.locate(ns, keys).tiers if ns is not None else []
        tiers: list[tuple[TierName, int]] = []
        for t in self.tiers.values():
            tiers.append((t.name, sum(1 for _ in takewhile(t.name.__eq__, where))))
        for name, book in self.lower.items():
            entries = book.entries
            held = 0
            for k in keys:
                e = entries.get((namespace, k))
                if e is None or e.state is not STORED:
                    break
                held += 1
            tiers.append((name, held))
        if ns is not None:
            stored = len(where)
        else:   # only the tiers below may hold a namespace no session named since start-up
            stored = max((n for name, n in tiers if name in self.lower), default=0)
        return Placement(namespace, found, tiers, stored)

    def gpu_holder(self: "Ledger", sid: SessionId,
                   keys: Sequence[bytes]) -> tuple[Optional[EngineBook], int]:
        """The engine other than `sid`'s holding the longest leading run of
        `keys` in `sid`'s namespace (keys checked already, by a Match)."""
        session = self.sessions.get(sid)
        if session is None or session.ns.id not in self.residency.by_namespace:
            return None, 0
        return self.residency.holder(session.ns.id, keys, besides=sid)
