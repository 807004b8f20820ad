"""The seed's five mechanism tests, ported to the ledger.

Seed: /work/shared/seeds/000_cb805b194f5c00ed.txt (KVCacheLifecycleSim). The seed
keeps one record per prefix with a block count; the ledger keeps one entry per
block key with a page count. Where the seed's numbers are reproduced exactly,
a seed "record" is one ledger block and a seed "block" is one ledger page
(block_bytes = 2 pages); elsewhere a seed record is a chain of keys.
"""
from __future__ import annotations

import pytest

from kvkeeper.server.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvkeeper.server.ledger import BlockState, SlotStatus
from kvkeeper.server.ledger.units import blocks_for_tokens, full_blocks, pages_for_bytes

PRESENT, RESERVED, IN_FLIGHT = SlotStatus.PRESENT, SlotStatus.RESERVED, SlotStatus.IN_FLIGHT


# ---------------------------------------------------------------- seed test 1
# test_block_rounding_and_input_contract: ceil rounding at 1, at the boundary and
# past it; zero tokens and an empty prefix are rejected.
def test_block_rounding():
    assert [blocks_for_tokens(t, 4) for t in (1, 4, 5, 8, 9)] == [1, 1, 2, 2, 3]
    assert [pages_for_bytes(b, 100) for b in (1, 100, 101, 200, 201)] == [1, 1, 2, 2, 3]
    # Only completely filled blocks are saved by the connector.
    assert [full_blocks(t, 4) for t in (0, 3, 4, 5, 8)] == [0, 0, 1, 1, 2]


@pytest.mark.parametrize("fn", [blocks_for_tokens, full_blocks, pages_for_bytes])
def test_rounding_rejects_a_non_positive_unit(fn):
    with pytest.raises(InvalidArgument, match="must be positive"):
        fn(8, 0)


@pytest.mark.parametrize("fn", [blocks_for_tokens, pages_for_bytes])
@pytest.mark.parametrize("n", [0, -4])
def test_rounding_rejects_a_non_positive_count(fn, n):
    # The seed's `_blocks_for_tokens(0)` raising.
    with pytest.raises(InvalidArgument, match="must be positive"):
        fn(n, 4)


def test_a_partial_page_takes_a_whole_page(make_ledger, descriptor, key):
    # A block of 150 B in 100 B pages is charged 2 pages, like 5 tokens take 2 blocks.
    led = make_ledger(6)
    s = led.register_session("i", descriptor(block_bytes=150), 0.0)
    assert s.ns.pages_per_block == pages_for_bytes(150, 100) == 2
    led.reserve(s.id, [key(1)], 0.0)
    assert led.top.used_pages == 2


@pytest.mark.parametrize("bad", [b"", b"\x00" * 31, b"\x00" * 33])
def test_an_empty_or_malformed_key_is_rejected(make_ledger, descriptor, snapshot, bad):
    # The seed's `acquire('', 4)` raising: the ledger's prefix is a fixed-length key.
    led = make_ledger()
    s = led.register_session("i", descriptor(), 0.0)
    before = snapshot(led)
    with pytest.raises(InvalidArgument):
        led.reserve(s.id, [bad], 0.0)
    with pytest.raises(InvalidArgument):
        led.match(s.id, [bad], lease=True, now=0.0)
    assert snapshot(led) == before


# ---------------------------------------------------------------- seed test 2
# test_shared_reference_does_not_duplicate_blocks: acquiring the same prefix twice
# returns the same record with ref_count 2 and hits 2, and no new block.
def test_shared_reference_does_not_duplicate_blocks(make_ledger, descriptor, key, store):
    led = make_ledger(6)
    a = led.register_session("a", descriptor(), 0.0)
    b = led.register_session("b", descriptor(), 0.0)
    assert a.ns is b.ns                      # same descriptor, same namespace
    chain = [key(i) for i in range(blocks_for_tokens(6, 4))]   # 6 tokens -> 2 blocks
    store(led, a.id, chain)
    blocks_before = led.top.used_pages
    first = [led.block(a.ns.id, k) for k in chain]

    m1 = led.match(a.id, chain, lease=True, now=1.0)
    m2 = led.match(b.id, chain, lease=True, now=2.0)
    assert m1.matched == m2.matched == 2 and m1.lease_id != m2.lease_id
    second = [led.block(b.ns.id, k) for k in chain]
    assert all(x is y for x, y in zip(first, second))
    assert [blk.refs for blk in second] == [2, 2]
    assert [blk.hits for blk in second] == [2, 2]
    assert led.top.used_pages == blocks_before == 2
    # Saving the same prefix again is a no-op, not a copy.
    res = led.reserve(b.id, chain, 3.0)
    assert res.reservation_id is None and res.statuses == [PRESENT, PRESENT]
    assert led.top.used_pages == 2 and led.top.blocks == 2
    led.check_invariants()


# ---------------------------------------------------------------- seed test 3
# test_append_allocates_only_at_tail_boundary: 3 tokens, +1 (still one block, 0 new),
# +1 (crosses into a second block, 1 new); final (5 tokens, 2 blocks).
# In the ledger the tail grows by reserving a longer key chain: only the new
# trailing keys take pages, the committed prefix comes back PRESENT.
def test_reserving_a_longer_chain_allocates_only_the_new_tail(make_ledger, descriptor, key):
    led = make_ledger(6)
    s = led.register_session("i", descriptor(block_tokens=4), 0.0)
    chain = [key(i) for i in range(4)]

    assert full_blocks(3, 4) == 0            # 3 tokens: nothing complete to save yet
    tokens = 4                               # +1 token fills the first block
    res = led.reserve(s.id, chain[:full_blocks(tokens, 4)], 1.0)
    assert res.statuses == [RESERVED] and led.top.used_pages == 1
    led.commit(s.id, res.reservation_id, 1.0)

    tokens = 5                               # +1 more: still one full block, 0 added
    res = led.reserve(s.id, chain[:full_blocks(tokens, 4)], 2.0)
    assert res.statuses == [PRESENT] and res.reservation_id is None
    assert res.blocks == [None] and led.top.used_pages == 1
    assert blocks_for_tokens(tokens, 4) == 2  # the seed's (used_tokens, block_count) == (5, 2)

    tokens = 8                               # the second block completes: exactly 1 added
    res = led.reserve(s.id, chain[:full_blocks(tokens, 4)], 3.0)
    assert res.statuses == [PRESENT, RESERVED]
    assert res.blocks[0] is None and res.blocks[1] is led.block(s.ns.id, chain[1])
    assert led.top.used_pages == 2 and led.top.pending_blocks == 1
    assert led.commit(s.id, res.reservation_id, 3.0) == 1
    assert led.match(s.id, chain, lease=False, now=4.0).matched == 2
    led.check_invariants()


def test_a_tail_still_being_written_is_in_flight_not_duplicated(make_ledger, descriptor, key):
    led = make_ledger(6)
    a = led.register_session("a", descriptor(), 0.0)
    b = led.register_session("b", descriptor(), 0.0)
    chain = [key(i) for i in range(3)]
    ra = led.reserve(a.id, chain[:2], 0.0)
    rb = led.reserve(b.id, chain, 0.0)
    assert rb.statuses == [IN_FLIGHT, IN_FLIGHT, RESERVED]
    assert led.top.used_pages == 3
    # In-flight blocks are invisible to match until their writer commits.
    assert led.match(b.id, chain, lease=False, now=0.0).matched == 0
    led.commit(a.id, ra.reservation_id, 0.0)
    led.commit(b.id, rb.reservation_id, 0.0)
    assert led.match(b.id, chain, lease=False, now=0.0).matched == 3
    led.check_invariants()


# ---------------------------------------------------------------- seed test 4
# test_release_reclaim_and_active_protection, with the seed's numbers: 5 blocks,
# cold/active/new take 2 each; new evicts the released cold, never the active;
# afterwards 4 allocated, 1 free; release(new, keep_reusable=False) reclaims at
# once (2 allocated); appending to the reclaimed record fails.
def test_release_reclaim_and_active_protection(make_ledger, descriptor, key, store, policy):
    led = make_ledger(5, policy=policy)
    s = led.register_session("i", descriptor(block_bytes=200), 0.0)   # 2 pages per record
    cold, active, new = key(1), key(2), key(3)
    ns = s.ns.id

    store(led, s.id, [cold], 1.0)
    lease_cold = led.match(s.id, [cold], lease=True, now=1.0).lease_id
    led.release(s.id, lease_cold, 2.0)                  # reusable: refs 0, kept
    assert led.block(ns, cold).state is BlockState.COMMITTED and led.block(ns, cold).refs == 0

    store(led, s.id, [active], 3.0)
    lease_active = led.match(s.id, [active], lease=True, now=3.0).lease_id   # stays referenced

    store(led, s.id, [new], 4.0)                         # must evict cold, never active
    assert led.block(ns, cold) is None
    assert led.top.evictions["capacity"] == 1
    assert led.block(ns, active).refs == 1 and led.block(ns, active).state is BlockState.COMMITTED
    assert led.top.used_pages == 4 and led.top.free_pages == 1

    lease_new = led.match(s.id, [new], lease=True, now=5.0).lease_id
    led.release(s.id, lease_new, 6.0, discard=True)      # keep_reusable=False
    assert led.block(ns, new) is None and led.top.used_pages == 2
    assert led.top.evictions["discarded"] == 1
    # Using the reclaimed record again fails: it no longer matches, its lease is gone.
    assert led.match(s.id, [new], lease=True, now=7.0).matched == 0
    with pytest.raises(FailedPrecondition):
        led.release(s.id, lease_new, 7.0)
    assert led.block(ns, active).refs == 1
    led.release(s.id, lease_active, 8.0)
    led.check_invariants()


def test_discard_only_reclaims_blocks_nobody_else_holds(make_ledger, descriptor, key, store):
    # The seed: "仍有其他引用时不得 reclaim" - no reclaim while other references remain.
    led = make_ledger(4)
    a = led.register_session("a", descriptor(), 0.0)
    b = led.register_session("b", descriptor(), 0.0)
    chain = [key(1), key(2)]
    store(led, a.id, chain)
    la = led.match(a.id, chain, lease=True, now=0.0).lease_id
    lb = led.match(b.id, chain[:1], lease=True, now=0.0).lease_id
    led.release(a.id, la, 1.0, discard=True)
    assert led.block(a.ns.id, chain[0]).refs == 1        # still b's
    assert led.block(a.ns.id, chain[1]) is None          # nobody else: reclaimed
    led.release(b.id, lb, 2.0)
    assert led.block(a.ns.id, chain[0]).refs == 0        # kept as reusable
    led.check_invariants()


def test_eviction_takes_a_chain_from_its_tail(make_ledger, descriptor, key, store, policy):
    """A partly evicted prefix must stay matchable: evicting its head would strand the rest.

    vLLM's free queue frees a request's blocks in reverse for the same reason.
    """
    led = make_ledger(4, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    cold = [key(i) for i in range(4)]
    store(led, s.id, cold, 0.0)
    led.release(s.id, led.match(s.id, cold, lease=True, now=1.0).lease_id, 1.0)

    def surviving() -> list[bytes]:
        return [k for k in cold if led.block(s.ns.id, k) is not None]

    for i in range(6):                                   # evict one page at a time
        store(led, s.id, [key(10 + i)], 2.0 + i)
        assert led.top.evictions["capacity"] == i + 1
        left = surviving()
        assert left == cold[:len(left)]                  # what is left is always a prefix
        assert len(left) < 4                             # the first store had to evict cold
    if policy == "lru":
        assert surviving() == []
    led.check_invariants()


def test_a_partly_evicted_chain_still_matches_its_prefix(make_ledger, descriptor, key, store,
                                                         policy):
    led = make_ledger(4, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    cold = [key(i) for i in range(4)]
    store(led, s.id, cold, 0.0)                          # committed, never leased
    store(led, s.id, [key(10)], 1.0)
    assert led.block(s.ns.id, cold[3]) is None
    assert led.match(s.id, cold, lease=False, now=2.0).matched == 3
    led.check_invariants()


# ---------------------------------------------------------------- seed test 5
# test_capacity_failure_preserves_active_records: 3 blocks, a (2) and b (1) active;
# acquiring c fails, a and b remain, allocated == total.
def test_capacity_failure_preserves_active_records(make_ledger, descriptor, key, store,
                                                   snapshot, policy):
    led = make_ledger(3, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    a, b, c = [key(1), key(2)], [key(3)], [key(4)]
    store(led, s.id, a)
    store(led, s.id, b)
    la = led.match(s.id, a, lease=True, now=0.0).lease_id
    lb = led.match(s.id, b, lease=True, now=0.0).lease_id
    before = snapshot(led)
    with pytest.raises(ResourceExhausted) as info:
        led.reserve(s.id, c, 0.0)
    assert "queue, preempt or skip" in str(info.value)
    assert snapshot(led) == before                       # exactly unchanged
    assert {k for k in led.namespaces[s.ns.id].blocks} == set(a + b)
    assert led.top.used_pages == led.top.capacity_pages == 3
    assert led.top.evictions["capacity"] == 0
    led.check_invariants()
    # Freeing one reference is enough for the next try to succeed.
    led.release(s.id, lb, 1.0)
    res = led.reserve(s.id, c, 1.0)
    assert res.statuses == [RESERVED] and led.block(s.ns.id, b[0]) is None
    assert all(led.block(s.ns.id, k).refs == 1 for k in a)
    assert la in led.leases


def test_capacity_failure_counts_pending_writes_as_active(make_ledger, descriptor, key,
                                                          snapshot):
    led = make_ledger(3)
    s = led.register_session("i", descriptor(), 0.0)
    led.reserve(s.id, [key(1), key(2)], 0.0)             # pending, not evictable
    led.commit(s.id, led.reserve(s.id, [key(3)], 0.0).reservation_id, 0.0)  # evictable
    before = snapshot(led)
    with pytest.raises(ResourceExhausted):
        led.reserve(s.id, [key(4), key(5)], 0.0)         # 2 needed, 0 free + 1 evictable
    assert snapshot(led) == before                       # the evictable block survived
    assert led.block(s.ns.id, key(3)) is not None
