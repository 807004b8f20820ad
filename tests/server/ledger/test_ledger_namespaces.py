"""Namespaces, admin reclaim, ledger construction and the counters metrics read."""
from __future__ import annotations

import dataclasses

import pytest

from kvkeeper.server.errors import InvalidArgument
from kvkeeper.server.ids import DISK, HOST
from kvkeeper.server.ledger import BlockState, Ledger, LedgerConfig, SlotStatus, TierSpec


@pytest.mark.parametrize("field,value", [
    ("model_id", "other"), ("block_tokens", 8), ("block_bytes", 200), ("model_revision", "r2"),
    ("dtype", "fp8"), ("kv_layout", "NHD"), ("tp_rank", 1), ("cache_salt", "s"),
    ("lora_tag", "adapter"),
])
def test_any_descriptor_field_separates_namespaces(make_ledger, descriptor, key, store,
                                                   field, value):
    led = make_ledger()
    base = descriptor(tp_size=2)
    other = dataclasses.replace(base, **{field: value})
    a = led.register_session("a", base, 0.0)
    b = led.register_session("b", other, 0.0)
    assert a.ns is not b.ns and a.ns.id != b.ns.id
    store(led, a.id, [key(1)])
    assert led.match(b.id, [key(1)], lease=False, now=0.0).matched == 0
    r = led.reserve(b.id, [key(1)], 0.0)                    # same key, its own block
    assert r.statuses == [SlotStatus.RESERVED]
    assert led.block(a.ns.id, key(1)) is not led.block(b.ns.id, key(1))
    led.check_invariants()


def test_equal_descriptors_share_one_namespace(make_ledger, descriptor):
    led = make_ledger()
    a = led.register_session("a", descriptor(dtype="bf16"), 0.0)
    b = led.register_session("b", descriptor(dtype="bf16"), 0.0)
    assert a.ns is b.ns and len(led.namespaces) == 1 and a.ns.sessions == 2
    assert a.id != b.id
    assert a.ns.id == descriptor(dtype="bf16").digest() and len(a.ns.id) == 16


def test_reclaim_unpinned_keeps_leased_and_pending_blocks(make_ledger, descriptor, key, store):
    led = make_ledger(8)
    s = led.register_session("a", descriptor(), 0.0)
    store(led, s.id, [key(1), key(2), key(3)])
    led.match(s.id, [key(1)], lease=True, now=0.0)
    led.reserve(s.id, [key(4)], 0.0)
    assert led.reclaim_unpinned() == 2
    assert led.block(s.ns.id, key(1)).state is BlockState.COMMITTED
    assert led.block(s.ns.id, key(4)).state is BlockState.PENDING
    assert led.block(s.ns.id, key(2)) is None and led.block(s.ns.id, key(3)) is None
    assert led.top.evictions["admin"] == 2 and led.top.used_pages == 2
    assert led.reclaim_unpinned() == 0
    led.check_invariants()


def test_reclaim_unpinned_of_one_namespace(make_ledger, descriptor, key, store):
    led = make_ledger(8)
    a = led.register_session("a", descriptor("a"), 0.0)
    b = led.register_session("b", descriptor("b"), 0.0)
    store(led, a.id, [key(1), key(2)])
    store(led, b.id, [key(1)])
    assert led.reclaim_unpinned(b.ns.id) == 1
    assert led.block(b.ns.id, key(1)) is None
    assert led.block(a.ns.id, key(1)) is not None and led.block(a.ns.id, key(2)) is not None
    assert led.reclaim_unpinned(b"\x00" * 16) == 0          # unknown namespace: nothing
    assert led.reclaim_unpinned() == 2
    led.check_invariants()


def test_block_lookup_of_unknown_namespace_or_key(make_ledger, descriptor, key):
    led = make_ledger()
    s = led.register_session("a", descriptor(), 0.0)
    assert led.block(b"\x00" * 16, key(1)) is None
    assert led.block(s.ns.id, key(1)) is None


def test_construction_errors():
    with pytest.raises(ValueError, match="at least one tier"):
        Ledger(LedgerConfig(tiers=[]))
    with pytest.raises(ValueError, match="unknown eviction policy 'mru'"):
        Ledger(LedgerConfig(tiers=[TierSpec(HOST, 1000, 100)], policy="mru"))
    with pytest.raises(ValueError, match="holds no page"):
        Ledger(LedgerConfig(tiers=[TierSpec(HOST, 99, 100)]))
    with pytest.raises(ValueError, match="holds no page"):
        Ledger(LedgerConfig(tiers=[TierSpec(HOST, 1000, 0)]))


def test_a_partial_trailing_page_of_capacity_is_not_used():
    led = Ledger(LedgerConfig(tiers=[TierSpec(HOST, 1050, 100)]))
    assert led.top.capacity_pages == 10 and led.top.free_pages == 10


def test_key_length_is_configurable(descriptor):
    led = Ledger(LedgerConfig(tiers=[TierSpec(HOST, 1000, 100)], key_bytes=16))
    s = led.register_session("a", descriptor(), 0.0)
    assert led.reserve(s.id, [b"k" * 16], 0.0).statuses == [SlotStatus.RESERVED]
    with pytest.raises(InvalidArgument, match="every key must be 16 bytes"):
        led.reserve(s.id, [b"k" * 32], 0.0)


def test_counters_for_metrics(make_ledger, descriptor, key, store):
    led = make_ledger(8)
    s = led.register_session("a", descriptor(block_tokens=16, block_bytes=150), 0.0)
    store(led, s.id, [key(1), key(2)])
    t = led.top
    assert (t.committed_blocks, t.committed_bytes) == (2, 300)
    assert (t.blocks, t.pending_blocks) == (2, 0)
    led.reserve(s.id, [key(3)], 0.0)
    assert (t.blocks, t.pending_blocks) == (3, 1)
    led.match(s.id, [key(1), key(2), key(3)], lease=False, now=1.0)   # 2 hits, stops at pending
    led.match(s.id, [key(9)], lease=True, now=1.0)                     # a miss
    assert (led.lookups, led.lookup_keys) == (2, 4)
    assert (t.hit_blocks, t.hit_tokens) == (2, 32)
    assert [led.block(s.ns.id, k).hits for k in (key(1), key(2))] == [1, 1]
    assert t.used_pages == 6 and t.pinned_pages == 2 and t.evictable_pages == 4


def test_an_internal_match_pins_without_counting_or_reordering(make_ledger, descriptor, key,
                                                               store, policy):
    led = make_ledger(8, policy=policy)
    s = led.register_session("a", descriptor(), 0.0)
    chain = [key(1), key(2), key(3)]
    store(led, s.id, chain)
    order = [b.key for b in led.top.policy]
    counters = (led.lookups, led.lookup_keys, led.top.hit_blocks, led.top.hit_tokens)
    m = led.pin_internal(s.ns, chain[:2])
    assert m is not None and len(m.blocks) == 2 and m.session is led.internal
    assert (led.lookups, led.lookup_keys, led.top.hit_blocks, led.top.hit_tokens) == counters
    assert [led.block(s.ns.id, k).hits for k in chain] == [0, 0, 0]
    assert [led.block(s.ns.id, k).refs for k in chain] == [1, 1, 0]
    assert [b.key for b in led.top.policy] == [k for k in order if k == chain[2]]
    led.check_invariants()


def test_hits_counted_elsewhere_are_not_counted_twice(make_ledger, descriptor, key, store):
    led = make_ledger(8)
    s = led.register_session("a", descriptor(block_tokens=16), 0.0)
    chain = [key(1), key(2), key(3)]
    store(led, s.id, chain)
    led.match(s.id, chain, lease=False, now=1.0, below={0: DISK, 2: DISK})
    assert (led.top.hit_blocks, led.top.hit_tokens) == (1, 16)
    assert led.lookups == 1 and led.lookup_keys == 3
    # Every block was still used: hits and recency move for all three.
    assert [led.block(s.ns.id, k).hits for k in chain] == [1, 1, 1]
