"""Saves of chains through AsyncClient against a real daemon: save(parent=)
files a save that continues a chain under the block it extends, a save split
into rounds links each round to the one before, a bad parent is refused
client-side; a one-off document on a full cache comes back not admitted."""
from __future__ import annotations

from typing import Any

import pytest

from kvkeeper.client import AsyncClient

BLOCK = 4096


def ns() -> dict:
    return dict(model_id="tiny", dtype="float16", kv_layout="NHD", block_tokens=32, block_bytes=BLOCK)


def keys(n: int, start: int = 0) -> list[bytes]:
    return [i.to_bytes(4, "little") * 8 for i in range(start, start + n)]


def blocks(n: int) -> list[bytes]:
    return [bytes([i % 251]) * BLOCK for i in range(n)]


def parents(daemon: Any, ks: list[bytes]) -> list[Any]:
    (namespace,) = daemon.ledger.namespaces.values()
    out = []
    for k in ks:
        p = namespace.blocks[k].parent
        out.append(p if p is None else p.key)
    return out


@pytest.mark.parametrize("transport", ["shm", "stream"])
async def test_saves_of_one_chain_link_across_calls(daemon: Any, transport: str) -> None:
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns(), transport=transport)
    try:
        ks = keys(5)
        assert (await c.save(ks[:2], blocks(2), parent=b"")).committed == 2
        assert (await c.save(ks[2:], blocks(3), parent=ks[1])).committed == 3
        assert parents(daemon, ks) == [None] + ks[:4]
        # Unknown (no Match stopped there): the block is filed under nothing.
        other = keys(1, start=100)
        await c.save(other, blocks(1))
        assert parents(daemon, other) == [None]
        daemon.ledger.check_invariants()
    finally:
        await c.close()


async def test_rounds_of_one_save_are_linked(daemon_factory: Any) -> None:
    d = await daemon_factory(**{"ledger.max_keys_per_call": 2})
    c = await AsyncClient.connect(f"unix://{d.socket_path}", ns())
    try:
        assert c.max_keys_per_call == 2
        ks = keys(5)
        assert (await c.save(ks, blocks(5), parent=b"")).committed == 5   # three rounds
        assert parents(d, ks) == [None] + ks[:4]
    finally:
        await c.close()


async def test_a_parent_of_the_wrong_length_is_refused_before_sending(daemon: Any) -> None:
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns())
    try:
        with pytest.raises(ValueError, match="parent key has 3 bytes"):
            await c.save(keys(1), blocks(1), parent=b"abc")
        assert not daemon.ledger.reservations and not any(
            n.blocks for n in daemon.ledger.namespaces.values())
    finally:
        await c.close()


async def test_a_one_off_document_on_a_full_cache_is_not_admitted_then_is(daemon: Any) -> None:
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns())
    try:
        for start in range(0, 64, 16):    # fill the 64-block arena in short runs
            assert (await c.save(keys(16, start), blocks(16))).committed == 16
        doc = keys(20, start=1000)
        r = await c.save(doc, blocks(20), parent=keys(1)[0])
        assert (r.reserved, r.committed, r.not_admitted) == (0, 0, 20)
        assert daemon.ledger.top.admission_refused == 20
        text = daemon.metrics.render().decode()
        assert 'kvkeeper_admission_refused_total{tier="host"} 20.0' in text
        r = await c.save(doc, blocks(20), parent=keys(1)[0])     # seen before: admitted
        assert (r.committed, r.not_admitted) == (20, 0)
        daemon.ledger.check_invariants()
    finally:
        await c.close()
