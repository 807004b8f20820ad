"""Per-namespace quotas: the pure check (quota.py) and its use in Ledger.reserve."""
from __future__ import annotations

import pytest

from kvkeeper.server.errors import ResourceExhausted
from kvkeeper.server.ledger.quota import ANY_MODEL, check_quota, quota_for

PAGE = 100  # tests/server/ledger/conftest.py: bytes per page of every test tier


def test_quota_for_prefers_the_model_then_any() -> None:
    quotas = {"a": 300, ANY_MODEL: 100}
    assert quota_for(quotas, "a") == 300
    assert quota_for(quotas, "b") == 100
    assert quota_for({"a": 300}, "b") is None
    assert quota_for({"a": 0}, "a") == 0      # zero is a quota (nothing may be saved), not "none"


def test_check_quota_allows_up_to_the_quota_and_names_it() -> None:
    check_quota(namespace="ab", model_id="m", quota_bytes=300, used_bytes=100, needed_bytes=200,
                blocks=2)
    with pytest.raises(ResourceExhausted) as info:
        check_quota(namespace="ab", model_id="m", quota_bytes=300, used_bytes=101,
                    needed_bytes=200, blocks=2)
    msg = str(info.value)
    assert "quota of 300 B" in msg and "'m'" in msg and "ab" in msg and "[quotas]" in msg


def test_reserve_over_quota_fails_and_changes_nothing(make_ledger, descriptor, key, store,
                                                      snapshot) -> None:
    led = make_ledger(16)
    led.quotas = {"m": 3 * PAGE}
    s = led.register_session("a", descriptor("m"), 0.0)
    store(led, s.id, [key(1), key(2)])
    before = snapshot(led)
    with pytest.raises(ResourceExhausted, match=f"quota of {3 * PAGE} B"):
        led.reserve(s.id, [key(3), key(4)], 0.0)
    assert snapshot(led) == before
    r = led.reserve(s.id, [key(1), key(3)], 0.0)          # one new block: fits exactly
    assert r.reservation_id is not None
    with pytest.raises(ResourceExhausted):                  # pending blocks count too
        led.reserve(s.id, [key(5)], 0.0)
    led.check_invariants()


def test_quota_counts_whole_pages(make_ledger, descriptor, key, store) -> None:
    led = make_ledger(16)
    led.quotas = {"m": 3 * PAGE}
    s = led.register_session("a", descriptor("m", block_bytes=PAGE + 1), 0.0)  # two pages each
    store(led, s.id, [key(1)])
    with pytest.raises(ResourceExhausted):
        led.reserve(s.id, [key(2)], 0.0)


def test_dropped_blocks_give_their_quota_back(make_ledger, descriptor, key, store) -> None:
    led = make_ledger(16)
    led.quotas = {"m": 2 * PAGE}
    s = led.register_session("a", descriptor("m"), 0.0)
    store(led, s.id, [key(1), key(2)])
    with pytest.raises(ResourceExhausted):
        led.reserve(s.id, [key(3)], 0.0)
    assert led.reclaim_unpinned(s.ns.id) == 2
    assert s.ns.used_pages == 0
    store(led, s.id, [key(3), key(4)])
    led.check_invariants()


def test_quota_is_per_namespace_and_per_model(make_ledger, descriptor, key, store) -> None:
    led = make_ledger(16)
    led.quotas = {"m": PAGE, ANY_MODEL: 2 * PAGE}
    rank0 = led.register_session("a", descriptor("m", tp_size=2, tp_rank=0), 0.0)
    rank1 = led.register_session("b", descriptor("m", tp_size=2, tp_rank=1), 0.0)
    other = led.register_session("c", descriptor("x"), 0.0)
    store(led, rank0.id, [key(1)])
    store(led, rank1.id, [key(1)])                          # its own namespace, its own quota
    store(led, other.id, [key(1), key(2)])                  # "*" applies to x
    for sid in (rank0.id, rank1.id, other.id):
        with pytest.raises(ResourceExhausted):
            led.reserve(sid, [key(9)], 0.0)
    led.quotas = {}                                         # a reload that removes quotas
    store(led, rank0.id, [key(9)])
    led.check_invariants()


def test_eviction_under_pressure_lowers_the_usage(make_ledger, descriptor, key, store) -> None:
    led = make_ledger(4)
    led.quotas = {"m": 3 * PAGE}
    s = led.register_session("a", descriptor("m"), 0.0)
    t = led.register_session("b", descriptor("x"), 0.0)
    store(led, s.id, [key(1), key(2), key(3)])
    store(led, t.id, [key(1), key(2), key(3)])               # evicts two of m's blocks
    assert s.ns.used_pages == 1
    store(led, s.id, [key(4), key(5)])
    led.check_invariants()
