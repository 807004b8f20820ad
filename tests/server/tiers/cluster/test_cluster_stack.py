"""The stack's side of a tier that keeps no book (keeps_book False, as the
cluster): probed in runs on every lookup, its found copies booked only while
a lookup uses them, so nothing of the medium is mirrored at rest, and
concurrent lookups of one chain do not forget each other's copies."""
from __future__ import annotations

import asyncio
import os
import uuid
from typing import Any, Iterator, Optional, Sequence

import pytest

from kvkeeper.client.arena_format import byte_view
from kvkeeper.server.errors import ClientError
from kvkeeper.server.ids import HOST, TierName
from kvkeeper.server.ledger import Ledger, LedgerConfig, NamespaceDescriptor, TierSpec
from kvkeeper.server.tiers.arena import HEADER_BYTES, Arena
from kvkeeper.server.tiers.backend import NotStored, TierError
from kvkeeper.server.tiers.stack import TierCounter, TierStack

PAGE = 4096
SHELF = TierName("shelf")


class ShelfTier:
    """A medium that others write and that forgets by itself: a dict."""

    name = SHELF
    keeps_book = False
    write_back = False
    admit_after_hits = 0

    def __init__(self, max_keys: int = 3) -> None:
        self.data: dict[tuple[bytes, bytes], bytes] = {}
        self.max_keys = max_keys
        self.probes: list[int] = []
        self.flush_failures = 0
        self.gate: Optional[asyncio.Event] = None

    def loc(self, ns: bytes, key: bytes, nbytes: int) -> tuple:
        return (ns, key, nbytes)

    async def probe_run(self, ns: bytes, keys: Sequence[bytes]) -> list[Optional[int]]:
        asked = list(keys[:self.max_keys])
        self.probes.append(len(asked))
        if self.gate is not None:
            await self.gate.wait()
        return [len(self.data[(ns, k)]) if (ns, k) in self.data else None for k in asked]

    async def read_block(self, loc: tuple, dst: Any, dst_loc: Any) -> None:
        await asyncio.sleep(0)
        if loc[:2] not in self.data:
            raise NotStored("gone")
        dst.write(dst_loc, self.data[loc[:2]])

    async def write_block(self, src: Any, src_loc: Any, loc: tuple, checksum: Any = None) -> None:
        out = bytearray(loc[2])
        src.read_into(src_loc, out)
        self.data[loc[:2]] = bytes(out)

    def refusal(self, e: TierError) -> Optional[ClientError]:
        return None

    async def forget(self, where: tuple[bytes, bytes]) -> None: ...
    async def maintain(self) -> None: ...
    async def close(self) -> None: ...

    def counters(self) -> list[TierCounter]:
        return []

    def errors(self) -> dict[str, int]:
        return {}


@pytest.fixture
def arena() -> Iterator[Arena]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    a = Arena.create(os.path.join(base, f"kvkeeper-shelf-{uuid.uuid4().hex}"),
                     HEADER_BYTES + 16 * PAGE, PAGE)
    yield a
    a.close()


def build(arena: Arena, tier: ShelfTier) -> tuple[Ledger, TierStack, Any]:
    led = Ledger(LedgerConfig(tiers=[TierSpec(HOST, 16 * PAGE, PAGE)]))
    led.add_book(SHELF, 1 << 40)
    stack = TierStack(led, arena, [tier], clock=lambda: 1.0)
    s = led.register_session("a", NamespaceDescriptor("m", block_tokens=4, block_bytes=PAGE), 0.0)
    return led, stack, s


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def shelve(tier: ShelfTier, s: Any, ids: Sequence[int]) -> None:
    for i in ids:
        tier.data[(s.ns.id, key(i))] = bytes([i]) * PAGE


def held_bytes(stack: TierStack, lease_id: Any, s: Any) -> list[bytes]:
    out = []
    for b in stack.ledger.leases[lease_id].blocks:
        out.append(bytes(byte_view(stack.host.view(stack.host.locate(s.ns.id, b.key, PAGE,
                                                                     b.pages)))))
    return out


async def test_probed_in_runs_promoted_and_forgotten(arena) -> None:
    tier = ShelfTier(max_keys=3)
    led, stack, s = build(arena, tier)
    shelve(tier, s, range(7))
    m = await stack.match(s.id, [key(i) for i in range(9)], lease=True)
    assert m.matched == 7 and m.tiers == [SHELF] * 7
    assert tier.probes == [3, 3, 3]        # runs of max_keys; the third ends at the gap, no 4th
    assert held_bytes(stack, m.lease_id, s) == [bytes([i]) * PAGE for i in range(7)]
    assert len(led.lower[SHELF]) == 0      # nothing booked at rest
    assert led.lower[SHELF].evictions == {}
    led.release(s.id, m.lease_id, 1.0)
    led.check_invariants()


async def test_a_lookup_without_lease_asks_again_each_time(arena) -> None:
    tier = ShelfTier()
    led, stack, s = build(arena, tier)
    shelve(tier, s, range(2))
    for _ in range(2):
        m = await stack.match(s.id, [key(0), key(1)], lease=False)
        assert m.matched == 2 and m.tiers == [SHELF, SHELF]
    assert tier.probes == [2, 2] and len(led.lower[SHELF]) == 0
    del tier.data[(s.ns.id, key(1))]       # the medium forgot it: the next lookup knows
    assert (await stack.match(s.id, [key(0), key(1)], lease=False)).matched == 1


async def test_a_copy_gone_between_probe_and_read_is_a_miss(arena) -> None:
    tier = ShelfTier()
    led, stack, s = build(arena, tier)
    shelve(tier, s, range(3))
    real = tier.read_block

    async def vanish(loc: tuple, dst: Any, dst_loc: Any) -> None:
        tier.data.pop((s.ns.id, key(1)), None)
        await real(loc, dst, dst_loc)

    tier.read_block = vanish  # type: ignore[method-assign]
    m = await stack.match(s.id, [key(i) for i in range(3)], lease=True)
    assert m.matched == 1 and len(led.lower[SHELF]) == 0
    led.check_invariants()


async def test_concurrent_lookups_of_one_chain_both_hit(arena) -> None:
    tier = ShelfTier(max_keys=8)
    led, stack, s = build(arena, tier)
    shelve(tier, s, range(4))
    ks = [key(i) for i in range(4)]
    first = asyncio.ensure_future(stack.match(s.id, ks, lease=True))
    await asyncio.sleep(0)
    tier.gate = asyncio.Event()            # the second lookup's probe waits
    second = asyncio.ensure_future(stack.match(s.id, ks, lease=False))
    await asyncio.sleep(0)
    tier.gate.set()
    a, b = await asyncio.gather(first, second)
    assert a.matched == 4 and b.matched == 4
    assert len(led.lower[SHELF]) == 0
    led.release(s.id, a.lease_id, 1.0)
    led.check_invariants()


async def test_saves_go_down_and_are_not_booked(arena) -> None:
    tier = ShelfTier()
    led, stack, s = build(arena, tier)
    ks = [key(i) for i in range(3)]
    r = led.reserve(s.id, ks, 1.0)
    for k, b in zip(ks, r.blocks):
        stack.host.write(stack.host.locate(s.ns.id, k, PAGE, b.pages), k[-1:] * PAGE)
    led.commit(s.id, r.reservation_id, 1.0)
    await stack.committed(s.ns, ks)
    assert sorted(tier.data) == sorted((s.ns.id, k) for k in ks)
    assert len(led.lower[SHELF]) == 0 and led.lower[SHELF].written_blocks == 3
    assert not led.internal.leases
    led.check_invariants()
