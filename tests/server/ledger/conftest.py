"""Shared builders for the ledger tests: a small ledger, keys, and a full snapshot.

`snapshot` captures everything a ClientError promises not to change (blocks,
pages, policy order, counters, sessions, leases, reservations, id counters),
so `snapshot(l) == before` proves a failed call left the ledger untouched.
"""
from __future__ import annotations

from typing import Any, Callable

import pytest

from kvkeeper.server.ids import HOST
from kvkeeper.server.ledger import Ledger, LedgerConfig, NamespaceDescriptor, TierSpec

PAGE = 100  # bytes per page in every test tier


def key(i: int, n: int = 32) -> bytes:
    """A distinct fixed-length block key."""
    return i.to_bytes(n, "big")


def descriptor(model: str = "m", block_bytes: int = PAGE, block_tokens: int = 4,
               **kw: Any) -> NamespaceDescriptor:
    return NamespaceDescriptor(model_id=model, block_tokens=block_tokens,
                               block_bytes=block_bytes, **kw)


def make_ledger(pages: int = 8, *, policy: str = "lru", page_bytes: int = PAGE,
                **cfg: Any) -> Ledger:
    cfg.setdefault("lease_ttl_s", 30.0)
    cfg.setdefault("reservation_timeout_s", 60.0)
    return Ledger(LedgerConfig(tiers=[TierSpec(HOST, pages * page_bytes, page_bytes)],
                               policy=policy, **cfg))


def _bkey(b: Any) -> tuple[bytes, bytes]:
    return (bytes(b.ns.id), bytes(b.key))


def snapshot(led: Ledger) -> dict[str, Any]:
    tiers = {}
    for name, t in led.tiers.items():
        tiers[name] = {
            "free_stack": t.pages.runs(),
            "policy": [_bkey(b) for b in t.policy],
            "policy_len": len(t.policy),
            "evictable_pages": t.evictable_pages,
            "blocks": t.blocks,
            "pending_blocks": t.pending_blocks,
            "evictions": dict(t.evictions),
            "hits": (t.hit_blocks, t.hit_tokens),
            "committed": (t.committed_blocks, t.committed_bytes),
        }
    namespaces = {}
    for nid, ns in led.namespaces.items():
        namespaces[bytes(nid)] = {
            "descriptor": ns.descriptor,
            "ppb": ns.pages_per_block,
            "sessions": ns.sessions,
            "used_pages": ns.used_pages,
            "blocks": {bytes(k): (b.state, b.refs, b.hits, b.last_used, b.pages, b.checksum,
                                  b.tier.name, b.prev is None, b.next is None)
                       for k, b in ns.blocks.items()},
        }
    sessions = {sid: (s.instance_id, bytes(s.ns.id), s.expires_at, sorted(s.leases),
                      sorted(s.reservations))
                for sid, s in led.sessions.items()}
    leases = {lid: (l.session.id, [_bkey(b) for b in l.blocks], l.first)
              for lid, l in led.leases.items()}
    reservations = {rid: (r.session.id, [None if b is None else _bkey(b) for b in r.entries],
                          r.expires_at, getattr(r, "written", None))
                    for rid, r in led.reservations.items()}
    counters = (led.session_table.issued, dict(led.session_table.per_owner), led._next_lease, led._next_reservation, led.lookups,
                led.lookup_keys, led.sessions_expired, led.reservations_timed_out,
                vars(led.usage).copy())
    return {"tiers": tiers, "namespaces": namespaces, "sessions": sessions, "leases": leases,
            "reservations": reservations, "counters": counters}


def store(led: Ledger, sid: str, keys: list[bytes], now: float = 0.0) -> None:
    """Reserve and commit `keys` (the ones not already present)."""
    res = led.reserve(sid, keys, now)
    if res.reservation_id is not None:
        led.commit(sid, res.reservation_id, now)


@pytest.fixture(name="key")
def _key_fixture() -> Callable[..., bytes]:
    return key


@pytest.fixture(name="descriptor")
def _descriptor_fixture() -> Callable[..., NamespaceDescriptor]:
    return descriptor


@pytest.fixture(name="make_ledger")
def _make_ledger_fixture() -> Callable[..., Ledger]:
    return make_ledger


@pytest.fixture(name="snapshot")
def _snapshot_fixture() -> Callable[[Ledger], dict[str, Any]]:
    return snapshot


@pytest.fixture(name="store")
def _store_fixture() -> Callable[..., None]:
    return store


@pytest.fixture(params=["lru", "hits-lru", "s3fifo"])
def policy(request: pytest.FixtureRequest) -> str:
    return request.param
