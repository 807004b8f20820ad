"""The tier stack over a real ledger, arena and disk tier, where callers give
up and saves race: an acknowledged write-through copy is never deleted by a
late eviction, a cancelled lookup or save leaves no pin, reservation or
WRITING entry behind and hangs nobody, write-through stores what admission
would turn away, and a promotion's reservation outlives its timeout."""
from __future__ import annotations

import asyncio
import os
import time
import uuid
from typing import Any, Iterator

import pytest

from kvkeeper.server.ids import HOST
from kvkeeper.server.ledger import Ledger, LedgerConfig, NamespaceDescriptor, TierSpec
from kvkeeper.server.ledger.disk_index import DiskState
from kvkeeper.server.tiers.arena import HEADER_BYTES, Arena
from kvkeeper.server.tiers.disk_tier import DiskTier
from kvkeeper.server.tiers.stack import TierStack

PAGE = 4096
DESC = NamespaceDescriptor("m", block_tokens=4, block_bytes=PAGE)


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


@pytest.fixture
def build(tmp_path: Any) -> Iterator[Any]:
    arenas: list[Arena] = []

    def make(pages: int = 8, disk_blocks: int = 64, policy: str = "lru") -> Any:
        led = Ledger(LedgerConfig(tiers=[TierSpec(HOST, pages * PAGE, PAGE)], policy=policy))
        a = Arena.create(f"/dev/shm/kvk-test-{uuid.uuid4().hex}", HEADER_BYTES + pages * PAGE,
                         PAGE)
        arenas.append(a)
        tier = DiskTier.open(led, path=str(tmp_path / uuid.uuid4().hex),
                             capacity_bytes=disk_blocks * PAGE, write_policy="write-through",
                             admit_after_hits=0, owner_id="test")
        stack = TierStack(led, a, [tier], clock=lambda: 1.0)
        return led, stack, tier, led.register_session("a", DESC, 0.0)
    yield make
    for a in arenas:
        a.close()


async def save(led: Ledger, stack: TierStack, s: Any, ks: list, fill: bytes = b"") -> None:
    """A client's save: reserve, write the arena, commit, then the stack (write-through)."""
    r = led.reserve(s.id, ks, 1.0)
    for k, b in zip(ks, r.blocks):
        if b is not None:
            stack.host.write(stack.host.locate(s.ns.id, k, s.ns.block_bytes, b.pages),
                             (fill or k[-1:]) * s.ns.block_bytes)
    led.commit(s.id, r.reservation_id, 1.0)
    await stack.committed(s.ns, [k for k, b in zip(ks, r.blocks) if b is not None])


def slow(obj: Any, name: str, seconds: float) -> None:
    real = getattr(obj, name)

    def late(*a: Any, **k: Any) -> Any:
        time.sleep(seconds)   # on the tier's thread: a slow medium
        return real(*a, **k)
    setattr(obj, name, late)


async def test_a_late_eviction_never_deletes_the_copy_a_save_just_acknowledged(build) -> None:
    for _ in range(10):
        led, stack, tier, s = build(pages=16, disk_blocks=5)
        big = led.register_session("b", NamespaceDescriptor("big", block_tokens=4,
                                                            block_bytes=4 * PAGE), 0.0)
        for i in range(1, 6):
            await save(led, stack, s, [key(i)])      # the disk holds 1..5: full
        led.reclaim_unpinned(s.ns.id)                 # and only the disk
        # Together: a 4-page block evicts 1..4 from the disk's book (their files
        # are deleted after), and 4 is saved again, answered once on disk.
        await asyncio.gather(save(led, stack, big, [key(100)], b"\xbb"),
                             save(led, stack, s, [key(4)]))
        assert led.lower["disk"].get(s.ns.id, key(4)) is not None
        assert os.path.exists(tier.store.block_path(s.ns.id, key(4)))
        led.reclaim_unpinned(s.ns.id)
        assert (await stack.match(s.id, [key(4)], lease=True)).matched == 1
        await stack.close()


async def slow_promotion(build: Any) -> Any:
    """Block 1 on disk only, its read slow: (ledger, stack, session, the
    leased lookup that promotes it, started)."""
    led, stack, tier, s = build()
    await save(led, stack, s, [key(1)])
    led.reclaim_unpinned(s.ns.id)
    slow(tier.store, "read_into", 0.3)
    return led, stack, s, asyncio.create_task(stack.match(s.id, [key(1)], lease=True))


async def test_a_cancelled_lookup_leaves_its_promotion_to_the_others(build) -> None:
    led, stack, s, first = await slow_promotion(build)
    await asyncio.sleep(0.05)
    second = asyncio.create_task(stack.match(s.id, [key(1)], lease=True))
    await asyncio.sleep(0.05)
    first.cancel()   # its caller gave up: grpc cancels the handler
    got = await asyncio.wait_for(second, 5.0)
    assert got.matched == 1
    assert not led.reservations or all(r.session is not led.internal
                                       for r in led.reservations.values())
    assert led.lower["disk"].get(s.ns.id, key(1)).pins == 0
    led.check_invariants()
    await stack.close()


async def test_a_cancelled_write_through_save_still_writes_its_block(build) -> None:
    led, stack, tier, s = build()
    slow(tier.store, "write", 0.3)
    t = asyncio.create_task(save(led, stack, s, [key(1)]))
    await asyncio.sleep(0.1)
    t.cancel()   # the CommitSave's caller gave up
    await asyncio.gather(t, return_exceptions=True)
    await stack.drain()
    entry = led.lower["disk"].entries[(s.ns.id, key(1))]
    assert entry.state is DiskState.STORED
    assert os.path.exists(tier.store.block_path(s.ns.id, key(1)))
    led.reclaim_unpinned(s.ns.id)
    assert (await stack.match(s.id, [key(1)], lease=True)).matched == 1
    await stack.close()


async def test_write_through_stores_what_admission_would_turn_away(build) -> None:
    led, stack, tier, s = build(disk_blocks=2, policy="s3fifo")
    for i in (1, 2, 3):   # the third a never-hit block on a full disk
        await save(led, stack, s, [key(i)])
        assert os.path.exists(tier.store.block_path(s.ns.id, key(i))), i
    await stack.close()


async def test_a_promotion_outlives_the_reservation_timeout(build) -> None:
    led, stack, s, t = await slow_promotion(build)
    await asyncio.sleep(0.1)
    for when in (25.0, 50.0, 75.0):   # the session lives on
        led.heartbeat(s.id, when)
    # Past the reservation timeout (60 s): the read is still writing its pages.
    assert led.expire(100.0).reservations == []
    assert (await t).matched == 1
    led.check_invariants()
    await stack.close()


def late_answer(obj: Any, name: str, seconds: float) -> None:
    """The call's answer, given `seconds` after it was found (a slow medium's reply)."""
    real = getattr(obj, name)

    def late(*a: Any, **k: Any) -> Any:
        got = real(*a, **k)
        time.sleep(seconds)
        return got
    setattr(obj, name, late)


@pytest.mark.parametrize("probe_slow", [False, True])
async def test_a_lookup_never_adopts_a_copy_its_eviction_is_deleting(build, probe_slow) -> None:
    """A lookup's probe of the disk, while an eviction deletes that key's file
    (still deleting, or done before the probe's answer comes back): adopted,
    the book would list a gone file, and a write-through save of the key
    would find it "already below" and be acknowledged with nothing written."""
    led, stack, tier, s = build(pages=16, disk_blocks=5)
    big = led.register_session("b", NamespaceDescriptor("big", block_tokens=4,
                                                        block_bytes=4 * PAGE), 0.0)
    await save(led, stack, s, [key(1)])          # disk: 1 (1 page)
    await save(led, stack, big, [key(2)])        # and 2 (4 pages): full
    led.reclaim_unpinned()                       # only the disk holds them
    slow(tier.store, "delete_if_unpinned", 0.3)
    if probe_slow:   # the probe finds the file, and answers after the delete ended
        late_answer(tier.store, "contains", 0.5)
    evicting = asyncio.create_task(save(led, stack, big, [key(3)], b"\xbb"))  # evicts 1 and 2
    await asyncio.sleep(0.1)
    assert (await stack.match(s.id, [key(1)], lease=False)).matched == 0
    await evicting
    assert not os.path.exists(tier.store.block_path(s.ns.id, key(1)))
    assert led.lower["disk"].get(s.ns.id, key(1)) is None
    await save(led, stack, s, [key(1)])          # acknowledged once on disk
    assert os.path.exists(tier.store.block_path(s.ns.id, key(1)))
    led.reclaim_unpinned()
    assert (await stack.match(s.id, [key(1)], lease=True)).matched == 1
    led.check_invariants()
    await stack.close()


async def test_a_flush_whose_evictions_delete_fails_leaves_no_entry_writing(build) -> None:
    """An unexpected error deleting the copy a reservation evicted fails that
    save; its own book entry must not stay WRITING (never written again,
    never promotable, its room taken for good)."""
    led, stack, tier, s = build(disk_blocks=2)
    await save(led, stack, s, [key(1)])
    await save(led, stack, s, [key(2)])          # the disk is full
    real = tier.forget

    async def boom(where: Any) -> None:
        tier.forget = real
        raise RuntimeError("the tier's executor is shut down")
    tier.forget = boom
    with pytest.raises(RuntimeError):
        await save(led, stack, s, [key(3)])      # evicts 1, whose delete raises
    entry = led.lower["disk"].entries.get((s.ns.id, key(3)))
    assert entry is None or entry.state is not DiskState.WRITING
    await stack.flusher.drain()
    led.check_invariants()
    await stack.close()
