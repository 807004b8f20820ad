"""Eviction under capacity pressure: how many, which, and at what cost.

Cost is checked structurally, never by timing: reserve pops exactly the victims
it needs from the policy and never walks the evictable set, and the policy only
ever holds committed, unreferenced blocks.
"""
from __future__ import annotations

import pytest

from kvkeeper.server.errors import FailedPrecondition, InvalidArgument, ResourceExhausted
from kvkeeper.server.ids import GPU, HOST
from kvkeeper.server.ledger import BlockState, Ledger, LedgerConfig, SlotStatus, TierSpec


class NoScanPolicy:
    """Wraps a tier's policy; fails the test if anything iterates it, counts pops."""

    def __init__(self, inner):
        self.inner, self.pops, self.adds, self.removes, self.hits = inner, 0, 0, 0, 0

    def add(self, b):
        self.adds += 1
        self.inner.add(b)

    def remove(self, b):
        self.removes += 1
        self.inner.remove(b)

    def pop(self):
        self.pops += 1
        return self.inner.pop()

    def hit(self, b):
        self.hits += 1
        self.inner.hit(b)

    def reread(self, b):
        self.hits += 1
        self.inner.reread(b)

    def hit_all(self, blocks, rereads=0):  # a lookup's run of hits, one call (counted per block)
        self.hits += len(blocks)
        self.inner.hit_all(blocks, rereads)

    def __len__(self):
        return len(self.inner)

    def __getattr__(self, name):   # chain moves (to_due, unpark): not pops, not scans
        return getattr(self.inner, name)

    def __iter__(self):
        raise AssertionError("the ledger walked the evictable set on a hot path")


def present_keys(led, ns_id):
    return set(led.namespaces[ns_id].blocks)


def fill(led, sid, keys, store):
    """Commit each key at its own time, so the LRU order is the key order."""
    for t, k in enumerate(keys):
        store(led, sid, [k], float(t))


@pytest.mark.parametrize("need", [1, 2, 4, 6])
def test_reserve_evicts_exactly_what_it_needs_in_policy_order(make_ledger, descriptor, key,
                                                              store, policy, need):
    led = make_ledger(6, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    old = [key(i) for i in range(6)]
    fill(led, s.id, old, store)
    # Hits reorder hits-lru; a hit also refreshes LRU recency.
    led.match(s.id, [old[0]], lease=False, now=10.0)
    led.match(s.id, [old[0], old[1]], lease=False, now=11.0)
    led.match(s.id, [old[4]], lease=False, now=12.0)
    order = [b.key for b in led.top.policy]
    if policy == "s3fifo":   # hit on probation: to main, in probation's order
        assert order == [old[2], old[3], old[5], old[0], old[1], old[4]]
    else:                    # hits-lru: the hit ones protected, least recent first
        assert order == [old[2], old[3], old[5], old[1], old[0], old[4]]
    led.top.policy = spy = NoScanPolicy(led.top.policy)
    new = [key(100 + i) for i in range(need)]
    res = led.reserve(s.id, new, 20.0)
    assert spy.pops == need                                # one pop per victim, no scan
    led.top.policy = spy.inner
    assert res.statuses == [SlotStatus.RESERVED] * need
    assert led.top.evictions["capacity"] == need
    assert present_keys(led, s.ns.id) == set(order[need:]) | set(new)
    assert [b.key for b in led.top.policy] == order[need:]  # survivors keep their order
    led.check_invariants()


def test_reserve_uses_free_pages_before_evicting(make_ledger, descriptor, key, store, policy):
    led = make_ledger(6, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    fill(led, s.id, [key(i) for i in range(4)], store)     # 4 used, 2 free
    order = [b.key for b in led.top.policy]
    led.top.policy = spy = NoScanPolicy(led.top.policy)
    led.reserve(s.id, [key(10), key(11)], 5.0)              # fits: no eviction at all
    assert spy.pops == 0
    led.reserve(s.id, [key(12)], 5.0)                       # 1 short: exactly one victim
    assert spy.pops == 1
    led.top.policy = spy.inner
    assert led.top.evictions["capacity"] == 1
    assert order[0] not in present_keys(led, s.ns.id)
    assert all(k in present_keys(led, s.ns.id) for k in order[1:])
    led.check_invariants()


def test_mixed_block_sizes_evict_a_minimal_prefix_of_the_order(make_ledger, descriptor, key,
                                                                store, policy):
    led = make_ledger(10, policy=policy)
    small = led.register_session("s", descriptor("small", block_bytes=100), 0.0)  # 1 page
    big = led.register_session("b", descriptor("big", block_bytes=300), 0.0)      # 3 pages
    t = 0.0
    for who, k in [(small, 1), (big, 2), (small, 3), (small, 4), (big, 5)]:    # 1+3+1+1+3 = 9
        store(led, who.id, [key(k)], t)
        t += 1
    victims_order = [(b.ns.pages_per_block, b.key) for b in led.top.policy]
    assert [p for p, _ in victims_order] == [1, 3, 1, 1, 3]
    led.top.policy = spy = NoScanPolicy(led.top.policy)
    led.reserve(big.id, [key(50), key(51)], t)               # 6 pages; 1 free -> 5 to free
    led.top.policy = spy.inner
    # Pages freed by the victims: 1, 3 (=4, short), then 1 (=5, enough): three victims.
    assert spy.pops == 3
    gone = {k for _, k in victims_order[:3]}
    kept = {k for _, k in victims_order[3:]}
    all_keys = present_keys(led, small.ns.id) | present_keys(led, big.ns.id)
    assert gone.isdisjoint(all_keys) and kept <= all_keys
    assert led.top.free_pages == 0
    led.check_invariants()


def test_policy_never_holds_pinned_or_pending_blocks(make_ledger, descriptor, key, store,
                                                     policy):
    led = make_ledger(8, policy=policy)
    a = led.register_session("a", descriptor(), 0.0)
    b = led.register_session("b", descriptor(), 0.0)
    store(led, a.id, [key(i) for i in range(5)])
    la = led.match(a.id, [key(0), key(1)], lease=True, now=1.0).lease_id
    lb = led.match(b.id, [key(0), key(1), key(2)], lease=True, now=2.0).lease_id
    led.reserve(a.id, [key(6), key(7)], 3.0)

    def check(expect_in_policy):
        held = [x.key for x in led.top.policy]
        assert set(held) == expect_in_policy and len(held) == len(led.top.policy)
        for blk in led.top.policy:
            assert blk.state is BlockState.COMMITTED and blk.refs == 0
        for k, blk in led.namespaces[a.ns.id].blocks.items():
            if blk.refs or blk.state is BlockState.PENDING:
                assert (blk.prev, blk.next) == (None, None)   # not linked anywhere
        assert led.top.evictable_pages == len(expect_in_policy)
        led.check_invariants()

    check({key(3), key(4)})
    led.release(a.id, la, 4.0)
    check({key(3), key(4)})                                 # b still holds 0 and 1
    led.release(b.id, lb, 5.0)
    check({key(0), key(1), key(2), key(3), key(4)})
    # Pinning again takes them back out.
    led.match(b.id, [key(0)], lease=True, now=6.0)
    check({key(1), key(2), key(3), key(4)})


def test_leased_blocks_are_never_chosen(make_ledger, descriptor, key, store, policy):
    led = make_ledger(4, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    fill(led, s.id, [key(i) for i in range(4)], store)
    led.match(s.id, [key(0)], lease=True, now=9.0)
    led.match(s.id, [key(2)], lease=True, now=9.0)
    led.reserve(s.id, [key(10), key(11)], 10.0)
    assert led.block(s.ns.id, key(0)).refs == 1 and led.block(s.ns.id, key(2)).refs == 1
    assert led.block(s.ns.id, key(1)) is None and led.block(s.ns.id, key(3)) is None
    with pytest.raises(ResourceExhausted):
        led.reserve(s.id, [key(12)], 11.0)
    led.check_invariants()


def test_hot_paths_never_walk_the_evictable_set(make_ledger, descriptor, key, store, policy):
    led = make_ledger(6, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    led.top.policy = spy = NoScanPolicy(led.top.policy)
    store(led, s.id, [key(i) for i in range(6)])
    lid = led.match(s.id, [key(0), key(1)], lease=True, now=1.0).lease_id
    led.match(s.id, [key(2)], lease=False, now=1.0)
    led.reserve(s.id, [key(7)], 2.0)
    led.release(s.id, lid, 3.0, discard=True)
    r = led.reserve(s.id, [key(8), key(9)], 4.0)
    led.abort(s.id, r.reservation_id, 5.0)
    led.top.policy = spy.inner
    assert spy.pops == 1 and spy.adds > 0 and spy.removes > 0 and spy.hits == 3
    led.check_invariants()


# ---------------------------------------------------------------- PRESENT keys
def test_a_reserve_never_evicts_the_keys_it_reports_present(make_ledger, descriptor, key,
                                                            store, policy):
    """The committed prefix of a longer chain is PRESENT: the client will not write it,
    so the same call must not evict it to make room for the tail."""
    led = make_ledger(3, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    chain = [key(i) for i in range(3)]
    store(led, s.id, chain[:2], 0.0)                        # the coldest blocks in the tier
    store(led, s.id, [key(50)], 1.0)                        # a younger, unrelated block
    res = led.reserve(s.id, chain, 2.0)                     # 1 new page needed, 0 free
    assert res.statuses == [SlotStatus.PRESENT, SlotStatus.PRESENT, SlotStatus.RESERVED]
    for k in chain[:2]:
        assert led.block(s.ns.id, k).state is BlockState.COMMITTED
    assert led.block(s.ns.id, key(50)) is None              # the victim had to be another block
    led.commit(s.id, res.reservation_id, 3.0)
    assert led.match(s.id, chain, lease=False, now=4.0).matched == 3
    led.check_invariants()


def test_present_keys_do_not_count_as_room_for_their_own_tail(make_ledger, descriptor, key,
                                                              store, snapshot, policy):
    led = make_ledger(2, policy=policy)
    s = led.register_session("i", descriptor(), 0.0)
    chain = [key(i) for i in range(3)]
    store(led, s.id, chain[:2], 0.0)                        # the only evictable blocks
    before = snapshot(led)
    with pytest.raises(ResourceExhausted) as info:
        led.reserve(s.id, chain, 0.0)
    assert "0 evictable, not counting the 2 present in this call" in str(info.value)
    assert snapshot(led) == before
    # Without the prefix in the request, the same room is fine to take.
    r = led.reserve(s.id, chain[2:], 1.0)
    assert r.statuses == [SlotStatus.RESERVED] and led.top.evictions["capacity"] == 1
    led.check_invariants()


# ---------------------------------------------------------------- chosen discards
def test_release_discards_only_the_chosen_positions(make_ledger, descriptor, key, store):
    led = make_ledger(8)
    s = led.register_session("i", descriptor(), 0.0)
    chain = [key(i) for i in range(4)]
    store(led, s.id, chain)
    lid = led.match(s.id, chain, lease=True, now=1.0).lease_id
    led.release(s.id, lid, 2.0, discard_indices=[3, 1])
    assert [led.block(s.ns.id, k) is not None for k in chain] == [True, False, True, False]
    assert led.top.evictions["discarded"] == 2 and led.top.evictable_pages == 2
    led.check_invariants()


def test_chosen_discards_spare_blocks_another_lease_holds(make_ledger, descriptor, key, store):
    led = make_ledger(8)
    a = led.register_session("a", descriptor(), 0.0)
    b = led.register_session("b", descriptor(), 0.0)
    chain = [key(i) for i in range(3)]
    store(led, a.id, chain)
    la = led.match(a.id, chain, lease=True, now=1.0).lease_id
    led.match(b.id, chain[:1], lease=True, now=1.0)
    led.release(a.id, la, 2.0, discard_indices=[0, 2, 2])  # repeats are harmless
    assert led.block(a.ns.id, chain[0]).refs == 1           # b's, so kept
    assert led.block(a.ns.id, chain[1]).refs == 0           # not chosen, kept
    assert led.block(a.ns.id, chain[2]) is None
    led.check_invariants()


@pytest.mark.parametrize("indices", [[4], [-1], [0, 9]])
def test_a_discard_index_outside_the_lease_changes_nothing(make_ledger, descriptor, key, store,
                                                           snapshot, indices):
    led = make_ledger(8)
    s = led.register_session("i", descriptor(), 0.0)
    chain = [key(i) for i in range(4)]
    store(led, s.id, chain)
    lid = led.match(s.id, chain, lease=True, now=0.0).lease_id
    before = snapshot(led)
    with pytest.raises(InvalidArgument) as info:
        led.release(s.id, lid, 0.0, discard_indices=indices)
    bad = next(i for i in indices if not 0 <= i < 4)
    assert f"discard index {bad}" in str(info.value) and f"lease {lid} of 4 blocks" in str(info.value)
    assert snapshot(led) == before                         # the lease is still held
    led.release(s.id, lid, 0.0)


# ---------------------------------------------------------------- the order a match leaves
@pytest.mark.parametrize("page_tiers", [1, 2])
def test_a_match_leaves_its_chain_most_recent_head_last_leased_blocks_aside(
        descriptor, key, store, policy, page_tiers):
    """Tail first: the head of a matched chain is evicted last; a leased block in
    the chain counts its hit but stays out of the order; with a second page tier
    each tier's policy gets its own run."""
    specs = [TierSpec(HOST, 8 * 100, 100)]
    if page_tiers == 2:
        specs.insert(0, TierSpec(GPU, 8 * 100, 100))
    led = Ledger(LedgerConfig(tiers=specs, policy=policy))
    s = led.register_session("i", descriptor(), 0.0)
    ks = [key(i) for i in range(6)]
    fill(led, s.id, ks, store)
    led.match(s.id, [ks[3]], lease=True, now=7.0)
    r = led.match(s.id, [ks[2], ks[3], ks[4], ks[1], key(9), ks[0]], lease=False, now=8.0)
    assert r.matched == 4
    order = [b.key for t in led.tiers.values() for b in t.policy]
    if policy == "s3fifo":   # a hit only counts: probation's order, the hit ones to main
        assert order == [ks[0], ks[5], ks[1], ks[2], ks[4]]
    else:
        assert order == [ks[0], ks[5], ks[1], ks[4], ks[2]]
    assert [led.block(s.ns.id, k).hits for k in ks] == [0, 1, 1, 2, 1, 0]
    assert [led.block(s.ns.id, k).last_used for k in ks[1:5]] == [8.0] * 4
    led.check_invariants()


# ---------------------------------------------------------------- a last turn's release
def test_a_last_turns_blocks_are_evicted_first_unless_read_again(make_ledger, descriptor, key,
                                                                   store, policy):
    """Release(last_turn): the chain the turn read goes to the front of the
    order (tail first, as chains go), before blocks saved long before it; a
    block another lease pins keeps its place; a block read again is not
    demoted any more."""
    led = make_ledger(8)
    s = led.register_session("i", descriptor(), 0.0)
    old = [key(100 + i) for i in range(4)]
    conv = [key(i) for i in range(4)]
    fill(led, s.id, old, store)
    store(led, s.id, conv, 5.0)
    other = led.match(s.id, conv[:1], lease=True, now=6.0).lease_id   # a shared first block
    last = led.match(s.id, conv, lease=True, now=6.0).lease_id
    led.release(s.id, last, 7.0, last_turn=True)
    order = [b.key for b in led.top.policy]
    assert order[:3] == [conv[3], conv[2], conv[1]] and led.top.last_turn_demoted == 3
    led.release(s.id, other, 7.0)
    assert led.match(s.id, conv[:2], lease=False, now=8.0).matched == 2   # read again
    store(led, s.id, [key(200)], 9.0)       # room for one: the demoted tail goes
    assert led.block(s.ns.id, conv[3]) is None
    assert all(led.block(s.ns.id, k) is not None for k in old + conv[:3])
    led.check_invariants()


def test_a_last_turn_flag_on_a_lease_that_is_gone_changes_nothing(make_ledger, descriptor, key,
                                                                   store, snapshot):
    led = make_ledger(8)
    s = led.register_session("i", descriptor(), 0.0)
    store(led, s.id, [key(0)])
    lid = led.match(s.id, [key(0)], lease=True, now=1.0).lease_id
    led.release(s.id, lid, 1.0)
    before = snapshot(led)
    with pytest.raises(FailedPrecondition):
        led.release(s.id, lid, 1.0, last_turn=True)
    assert snapshot(led) == before and led.top.last_turn_demoted == 0
