"""The tier stack over a real ledger and arena, with a tier below it written for
this test in a few lines: what adding a tier takes (a LowerTier, a BlockStore)."""
from __future__ import annotations

import os
import uuid
from typing import Any, Iterator, Optional

import pytest

from kvkeeper.client.arena_format import byte_view
from kvkeeper.server.errors import ClientError, Unavailable
from kvkeeper.server.ids import HOST, TierName
from kvkeeper.server.ledger import Ledger, LedgerConfig, NamespaceDescriptor, TierSpec
from kvkeeper.server.tiers.arena import HEADER_BYTES, Arena
from kvkeeper.server.tiers.backend import (CorruptBlock, NotStored, Reach, TierError, copy_block,
                                          copy_pieces, out_views)
from kvkeeper.server.tiers.stack import TierStack
from kvkeeper.v1 import kvkeeper_pb2 as pb

PAGE = 4096
MEM = TierName("mem")


class MemoryBackend:
    """A BlockStore in a dict."""

    name, persistent, tracks_presence, reach, capacity_bytes = "mem", False, True, Reach.STREAM, 1 << 20

    def __init__(self) -> None:
        self.data: dict[tuple[bytes, bytes], bytes] = {}
        self.corrupt: set[bytes] = set()
        self.sums: dict[tuple, Optional[tuple]] = {}   # kept with the bytes, as a disk does

    def used_bytes(self) -> int:
        return sum(map(len, self.data.values()))

    def locate(self, ns: bytes, key: bytes, nbytes: int, pages: Any = None) -> tuple:
        return (ns, key, nbytes)

    def write(self, loc: tuple, data: Any, checksum: Optional[tuple] = None) -> int:
        self.data[loc[:2]] = byte_view(data).tobytes()
        self.sums[loc[:2]] = checksum
        return loc[2]

    def read_into(self, loc: tuple, out: Any) -> Optional[tuple]:
        if loc[1] in self.corrupt:
            raise CorruptBlock("damaged for the test")
        if loc[:2] not in self.data:
            raise NotStored("not here")
        dst = out_views(out, loc[2])
        if isinstance(dst, list):   # a scatter read (the contract's list of buffers)
            copy_pieces([memoryview(self.data[loc[:2]])], dst)
        else:
            dst[:] = self.data[loc[:2]]
        return self.sums.get(loc[:2])

    def discard(self, loc: tuple) -> int:
        return len(self.data.pop(loc[:2], b""))

    def contains(self, loc: tuple) -> Optional[bool]:
        return loc[:2] in self.data

    def view(self, loc: tuple) -> None:
        return None

    def views(self, loc: tuple) -> None:
        return None


class MemoryTier:
    """A LowerTier over MemoryBackend, doing its "I/O" inline."""

    name = MEM
    keeps_book = True

    def __init__(self, write_back: bool = False, admit_after_hits: int = 0) -> None:
        self.backend = MemoryBackend()
        self.write_back, self.admit_after_hits, self.flush_failures = write_back, admit_after_hits, 0

    def loc(self, ns: bytes, key: bytes, nbytes: int) -> tuple:
        return self.backend.locate(ns, key, nbytes)

    async def probe_run(self, ns: bytes, keys: Any) -> list[Optional[int]]:
        return []

    async def read_block(self, loc: tuple, dst: Any, dst_loc: Any) -> Optional[tuple]:
        return copy_block(self.backend, loc, dst, dst_loc, loc[2])

    async def write_block(self, src: Any, src_loc: Any, loc: tuple,
                          checksum: Optional[tuple] = None) -> None:
        copy_block(src, src_loc, self.backend, loc, loc[2], checksum)

    def refusal(self, e: TierError) -> ClientError:
        return Unavailable(str(e))

    async def forget(self, where: tuple[bytes, bytes]) -> None:
        self.backend.data.pop(where, None)

    async def maintain(self) -> None: ...
    async def close(self) -> None: ...

    def counters(self) -> dict[str, float]:
        return {}

    def errors(self) -> dict[str, int]:
        return {"flush_failures": self.flush_failures}


@pytest.fixture
def arena() -> Iterator[Arena]:
    base = "/dev/shm" if os.path.isdir("/dev/shm") else "/tmp"
    a = Arena.create(os.path.join(base, f"kvkeeper-stack-{uuid.uuid4().hex}"),
                     HEADER_BYTES + 4 * PAGE, PAGE)
    yield a
    a.close()


def build(arena: Arena, **kw: Any) -> tuple[Ledger, TierStack, MemoryTier, Any]:
    led = Ledger(LedgerConfig(tiers=[TierSpec(HOST, 4 * PAGE, PAGE)]))
    tier = MemoryTier(**kw)
    led.add_book(MEM, 1 << 20)
    stack = TierStack(led, arena, [tier], clock=lambda: 1.0)
    s = led.register_session("a", NamespaceDescriptor("m", block_tokens=4, block_bytes=PAGE), 0.0)
    return led, stack, tier, s


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


async def save(led: Ledger, stack: TierStack, s: Any, ks: list[bytes], algo: int = 0) -> None:
    r = led.reserve(s.id, ks, 1.0)
    for k, b in zip(ks, r.blocks):
        if b is not None:
            stack.host.write(stack.host.locate(s.ns.id, k, PAGE, b.pages), k[-1:] * PAGE)
    sums = [1000 + k[-1] for k, b in zip(ks, r.blocks) if b is not None] if algo else []
    led.commit(s.id, r.reservation_id, 1.0, checksum_algo=algo, checksums=sums)
    await stack.committed(s.ns, [k for k, b in zip(ks, r.blocks) if b is not None])


async def test_write_through_then_promotion_of_an_evicted_block(arena) -> None:
    led, stack, tier, s = build(arena)
    await save(led, stack, s, [key(1)])
    assert tier.backend.data[(s.ns.id, key(1))] == b"\x01" * PAGE   # below before the answer
    await save(led, stack, s, [key(i) for i in range(2, 6)])       # the arena holds 4: 1 goes
    assert led.block(s.ns.id, key(1)) is None
    assert led.top.evictions == {"demoted": 1}
    m = await stack.match(s.id, [key(1)], lease=True)
    assert m.matched == 1 and m.tiers == [MEM] and m.lease_id is not None
    b = led.leases[m.lease_id].blocks[0]
    loc = stack.host.locate(s.ns.id, key(1), PAGE, b.pages)
    assert b.tier is led.top and bytes(stack.host.view(loc)) == b"\x01" * PAGE
    stats = {t.name: t for t in stack.tier_stats()}
    assert stats[MEM].hit_blocks == 1 and stats[MEM].hit_tokens == 4
    assert stats[HOST].hit_blocks == 0
    assert not led.internal.leases and not led.internal.reservations
    led.check_invariants()


async def test_a_promoted_block_keeps_its_writers_checksum(arena) -> None:
    # Readers verify a block with the checksum its writer committed: the lower
    # tier keeps it with the bytes, and promotion hands it back to the ledger.
    led, stack, tier, s = build(arena)
    await save(led, stack, s, [key(1)], algo=pb.CHECKSUM_XXH3_64)
    assert tier.backend.sums[(s.ns.id, key(1))] == (pb.CHECKSUM_XXH3_64, 1001)
    await save(led, stack, s, [key(i) for i in range(2, 6)], algo=pb.CHECKSUM_XXH3_64)
    assert led.block(s.ns.id, key(1)) is None
    m = await stack.match(s.id, [key(1)], lease=True)
    assert m.tiers == [MEM]
    assert led.leases[m.lease_id].blocks[0].checksum == (pb.CHECKSUM_XXH3_64, 1001)
    led.check_invariants()


async def test_write_back_pins_until_flushed(arena) -> None:
    led, stack, tier, s = build(arena, write_back=True)
    await save(led, stack, s, [key(1), key(2)])
    assert led.block(s.ns.id, key(1)).refs == 1                     # pinned until flushed
    await stack.drain()
    assert led.block(s.ns.id, key(1)).refs == 0 and len(tier.backend.data) == 2
    assert not led.leases
    led.check_invariants()


async def test_admission_after_hits(arena) -> None:
    led, stack, tier, s = build(arena, admit_after_hits=2)
    await save(led, stack, s, [key(1)])
    assert not tier.backend.data
    for _ in range(2):
        m = await stack.match(s.id, [key(1)], lease=True)
        led.release(s.id, m.lease_id, 1.0)
    await stack.drain()
    assert list(tier.backend.data) == [(s.ns.id, key(1))]
    led.check_invariants()


async def test_an_unreadable_copy_is_a_miss_and_leaves_the_book(arena) -> None:
    led, stack, tier, s = build(arena)
    await save(led, stack, s, [key(1), key(2)])
    led.reclaim_unpinned()
    tier.backend.corrupt.add(key(2))
    m = await stack.match(s.id, [key(1), key(2)], lease=True)
    assert m.matched == 1
    assert led.lower[MEM].evictions["corrupt"] == 1 and led.lower[MEM].get(s.ns.id, key(2)) is None
    led.check_invariants()


async def test_promoted_blocks_are_filed_under_the_block_before_them(arena) -> None:
    # A chain of 3 promoted from below keeps its links, so the eviction order
    # keeps each parent behind its child (chains.py).
    led, stack, tier, s = build(arena)
    ks = [key(i) for i in range(1, 4)]
    await save(led, stack, s, ks)
    led.reclaim_unpinned()
    m = await stack.match(s.id, ks, lease=True)
    assert m.matched == 3 and m.tiers == [MEM] * 3
    b1, b2, b3 = (led.block(s.ns.id, k) for k in ks)
    assert b1.parent is None and b2.parent is b1 and b3.parent is b2
    led.release(s.id, m.lease_id, 1.0)
    led.check_invariants()
