"""Hits and lookups as clients use them: a Match with report_use counts no hit,
the Release's LookupReport counts the prompt, what was asked beyond the
client's own cache and the blocks it loaded; narrowing a lease unpins the
blocks the client does not need."""
from __future__ import annotations

from typing import Any

import pytest

from kvkeeper.server.errors import InvalidArgument
from kvkeeper.server.ledger import LookupReport

BT = 4   # block_tokens of the conftest descriptor


def hits(led: Any) -> tuple[int, int]:
    return led.top.hit_blocks, led.top.hit_tokens


def usage(led: Any) -> tuple[int, int, int, int]:
    u = led.usage
    return u.lookup_blocks, u.lookup_tokens, u.prompt_blocks, u.prompt_tokens


@pytest.fixture
def led5(make_ledger: Any, descriptor: Any, key: Any, store: Any) -> tuple[Any, str, list]:
    """A ledger holding blocks 0..4 of one prompt's chain."""
    led = make_ledger(pages=16)
    sid = led.register_session("e", descriptor(), 0.0).id
    ks = [key(i) for i in range(8)]
    store(led, sid, ks[:5])
    return led, sid, ks


def test_a_plain_match_counts_every_key_asked_and_every_block_found(led5: Any) -> None:
    led, sid, ks = led5
    r = led.match(sid, ks[:7], lease=False, now=1.0)
    assert r.matched == 5
    assert hits(led) == (5, 5 * BT)
    assert usage(led) == (7, 7 * BT, 0, 0)


def test_report_use_counts_only_the_blocks_loaded_beyond_the_local_ones(led5: Any) -> None:
    led, sid, ks = led5
    # The prompt has 7 full blocks (30 tokens); the engine holds blocks 0-1,
    # the daemon 0-4: the engine loads 2-4.
    r = led.match(sid, ks[:7], lease=True, now=1.0, report_use=True)
    assert r.matched == 5 and r.lease_id
    assert hits(led) == (0, 0) and usage(led) == (0, 0, 0, 0)
    assert (led.lookups, led.lookup_keys) == (1, 7)   # what travelled
    loaded = led.release(sid, r.lease_id, 2.0,
                         report=LookupReport(prompt_tokens=30, prompt_blocks=7, local_blocks=2,
                                             loaded_blocks=3))
    assert loaded == 3
    assert hits(led) == (3, 3 * BT)
    assert usage(led) == (5, 5 * BT, 7, 30)
    assert not led.leases
    led.check_invariants()


def test_a_lookup_that_leased_nothing_reports_without_a_lease(led5: Any, key: Any) -> None:
    led, sid, _ = led5
    other = [key(100 + i) for i in range(3)]
    r = led.match(sid, other, lease=True, now=1.0, report_use=True)
    assert r.matched == 0 and r.lease_id is None
    assert led.release(sid, 0, 2.0, report=LookupReport(14, 3, 1, 0)) == 0
    assert hits(led) == (0, 0) and usage(led) == (2, 2 * BT, 3, 14)


def test_a_hit_entirely_in_the_engines_own_cache_counts_no_hit(led5: Any) -> None:
    led, sid, ks = led5
    r = led.match(sid, ks[:5], lease=True, now=1.0, report_use=True)
    led.release(sid, r.lease_id, 2.0, report=LookupReport(20, 5, 5, 0))
    assert hits(led) == (0, 0) and usage(led) == (0, 0, 5, 20)


def test_narrow_unpins_the_blocks_outside_the_kept_range(led5: Any) -> None:
    led, sid, ks = led5
    r = led.match(sid, ks[:5], lease=True, now=1.0, report_use=True)
    pinned = led.top.pinned_pages
    led.narrow(sid, r.lease_id, 2, 2, 1.5)
    lease = led.leases[r.lease_id]
    assert [b.key for b in lease.blocks] == ks[2:4] and lease.first == 2
    assert led.top.pinned_pages == pinned * 2 // 5
    led.check_invariants()
    # Report positions are lookup positions: blocks 2-3, lease positions 0-1;
    # discard indices are lease positions.
    assert led.release(sid, r.lease_id, 2.0, discard_indices=[1],
                       report=LookupReport(20, 5, 2, 2)) == 2
    assert hits(led) == (2, 2 * BT)
    assert led.block(led.sessions[sid].ns.id, ks[3]) is None   # discarded
    assert led.block(led.sessions[sid].ns.id, ks[4]) is not None
    led.check_invariants()


def test_tokens_count_on_tp_rank_0_only(make_ledger: Any, descriptor: Any, key: Any,
                                        store: Any) -> None:
    led = make_ledger(pages=16)
    s0 = led.register_session("e", descriptor(tp_rank=0, tp_size=2), 0.0).id
    s1 = led.register_session("e", descriptor(tp_rank=1, tp_size=2), 0.0).id
    ks = [key(i) for i in range(2)]
    for sid in (s0, s1):
        store(led, sid, ks)
        r = led.match(sid, ks, lease=True, now=1.0, report_use=True)
        led.release(sid, r.lease_id, 1.0, report=LookupReport(9, 2, 0, 2))
    # Two shards of 2 blocks each, one prompt of 9 tokens.
    assert hits(led) == (4, 2 * BT)
    assert usage(led) == (4, 2 * BT, 4, 9)


@pytest.mark.parametrize("report, fragment", [
    (LookupReport(30, 7, 2, 4), "holds lookup positions [0, 5)"),     # beyond the lease
    (LookupReport(30, 7, 6, 2), "more than the prompt's 7 full blocks"),
    (LookupReport(10, 7, 2, 3), "do not fit in a prompt of 10 tokens"),
    (LookupReport(30, 7, -1, 3), "report.local_blocks is negative"),
])
def test_a_bad_report_is_refused_and_changes_nothing(led5: Any, snapshot: Any, report: Any,
                                                     fragment: str) -> None:
    led, sid, ks = led5
    r = led.match(sid, ks[:7], lease=True, now=1.0, report_use=True)
    before = snapshot(led)
    with pytest.raises(InvalidArgument, match=fragment.replace("[", r"\[").replace(")", r"\)")):
        led.release(sid, r.lease_id, 1.0, report=report)
    assert snapshot(led) == before


def test_reports_refused_where_they_would_count_twice_or_load_without_a_lease(
        led5: Any, snapshot: Any) -> None:
    led, sid, ks = led5
    plain = led.match(sid, ks[:5], lease=True, now=1.0)
    before = snapshot(led)
    with pytest.raises(InvalidArgument, match="without report_use"):
        led.release(sid, plain.lease_id, 1.0, report=LookupReport(20, 5, 0, 5))
    with pytest.raises(InvalidArgument, match="loaded without a lease"):
        led.release(sid, 0, 1.0, report=LookupReport(20, 5, 0, 1))
    assert snapshot(led) == before


@pytest.mark.parametrize("start, count", [(0, 0), (4, 2), (-1, 2), (5, 1)])
def test_a_bad_narrow_is_refused_and_changes_nothing(led5: Any, snapshot: Any, start: int,
                                                     count: int) -> None:
    led, sid, ks = led5
    r = led.match(sid, ks[:5], lease=True, now=1.0, report_use=True)
    before = snapshot(led)
    with pytest.raises(InvalidArgument, match="not a non-empty range"):
        led.narrow(sid, r.lease_id, start, count, 1.0)
    assert snapshot(led) == before
