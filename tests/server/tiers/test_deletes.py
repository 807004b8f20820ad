"""Deletes: which copies a probe must not adopt (being deleted, or deleted
while it was out), and that what it remembers stays bounded."""
from __future__ import annotations

import asyncio

from kvkeeper.server.tiers import deletes as deletes_mod
from kvkeeper.server.tiers.deletes import Deletes

W = (b"n" * 16, b"k" * 32)


async def test_a_pending_delete_is_stale_to_every_probe_and_ends_with_its_event() -> None:
    d = Deletes()
    since = d.probe_started()
    marks, done = d.begin("disk", [W])
    assert d.stale("disk", W, since) and not d.stale("cluster", W, since)
    assert d.pending[("disk", W)] is done
    d.end(marks, done)
    assert done.is_set() and ("disk", W) not in d.pending
    assert d.stale("disk", W, since)             # ended while the probe was out
    assert not d.stale("disk", W, d.probe_started())   # a probe started after it
    d.probe_ended(since)


async def test_a_delete_that_ended_before_the_probe_started_is_not_stale() -> None:
    d = Deletes()
    marks, done = d.begin("disk", [W])
    d.end(marks, done)
    since = d.probe_started()
    assert not d.stale("disk", W, since)
    d.probe_ended(since)


async def test_a_later_eviction_of_the_same_key_keeps_its_own_mark() -> None:
    d = Deletes()
    m1, e1 = d.begin("disk", [W])
    m2, e2 = d.begin("disk", [W])
    d.end(m1, e1)
    assert d.pending[("disk", W)] is e2          # the first's end does not drop the second's
    d.end(m2, e2)
    assert not d.pending


async def test_memory_is_bounded_while_probes_keep_overlapping(monkeypatch) -> None:
    monkeypatch.setattr(deletes_mod, "PRUNE_ABOVE", 8)
    d = Deletes()
    old = d.probe_started()
    for i in range(200):   # always one probe out, each shorter than the deletes
        p = d.probe_started()
        w = (b"n" * 16, i.to_bytes(32, "big"))
        marks, done = d.begin("disk", [w])
        d.end(marks, done)
        d.probe_ended(old)
        old = p
    assert len(d._ended_at) <= 16
    d.probe_ended(old)
    assert not d._ended_at and not d._probes
    await asyncio.sleep(0)
