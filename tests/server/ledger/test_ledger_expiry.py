"""Time: session expiry, reservation timeout, heartbeats and expire()'s report.

The ledger never reads a clock; every call takes `now`. TTL 30 s, reservation
timeout 60 s (conftest defaults). A deadline is inclusive: expiry needs now > deadline.
"""
from __future__ import annotations

import pytest

from kvkeeper.server.errors import FailedPrecondition, ResourceExhausted
from kvkeeper.server.ledger import BlockState, ExpiryReport
from kvkeeper.server.ledger.pages import iter_pages


@pytest.fixture
def busy(make_ledger, descriptor, key, store):
    """Session a holds a lease on two committed blocks and one open reservation (t=0)."""
    led = make_ledger(8)
    a = led.register_session("a", descriptor(), 0.0)
    store(led, a.id, [key(1), key(2)], 0.0)
    lease = led.match(a.id, [key(1), key(2)], lease=True, now=0.0).lease_id
    res = led.reserve(a.id, [key(3), key(4)], 0.0).reservation_id
    assert led.top.used_pages == 4 and led.top.evictable_pages == 0
    return led, a, lease, res


def test_session_expiry_releases_leases_and_aborts_reservations(busy, key):
    led, a, lease, res = busy
    ns = a.ns
    report = led.expire(30.0)                     # at the deadline: still alive
    assert report == ExpiryReport() and a.id in led.sessions
    report = led.expire(30.5)
    assert report.sessions == [a.id]
    assert report.reservations == []              # its reservation went with the session
    assert a.id not in led.sessions and lease not in led.leases and res not in led.reservations
    assert ns.sessions == 0 and led.sessions_expired == 1 and led.reservations_timed_out == 0
    # Leased blocks are released, not discarded: still committed, now evictable.
    for k in (key(1), key(2)):
        b = led.block(ns.id, k)
        assert b.state is BlockState.COMMITTED and b.refs == 0
        assert b.last_used == 30.0                # released at the session's deadline
    # Pending blocks are gone. Their pages stay out of use until the
    # reservation's deadline (60) plus the timeout again: its writer may still
    # be copying (cooling.py).
    assert led.block(ns.id, key(3)) is None and led.block(ns.id, key(4)) is None
    assert led.top.used_pages == 4 and led.top.free_pages == 4
    assert led.top.evictable_pages == 2 and led.top.pending_blocks == 0
    assert led.top.evictions["aborted"] == 2
    led.check_invariants()
    assert led.expire(31.0) == ExpiryReport()     # nothing left to expire
    assert led.expire(120.0) == ExpiryReport(thawed_pages=2)
    assert led.top.used_pages == 2 and led.top.free_pages == 6
    led.check_invariants()


def test_expired_blocks_stay_usable_by_other_sessions(busy, descriptor, key):
    led, a, *_ = busy
    led.expire(31.0)
    b = led.register_session("b", descriptor(), 31.0)
    m = led.match(b.id, [key(1), key(2), key(3)], lease=True, now=31.0)
    assert m.matched == 2
    r = led.reserve(b.id, [key(3)], 31.0)         # a's aborted key can be saved again
    assert r.reservation_id is not None
    led.check_invariants()


def test_a_lapsed_session_is_dropped_on_its_next_call(busy, make_ledger, snapshot):
    """Calling after the deadline, before any expire(), does what expire() would have done."""
    led, a, lease, res = busy
    with pytest.raises(FailedPrecondition, match="expired: no heartbeat for 30s"):
        led.match(a.id, [], lease=False, now=40.0)
    assert a.id not in led.sessions and led.sessions_expired == 1
    lazily = snapshot(led)
    assert lazily["sessions"] == {} and lazily["leases"] == {} and lazily["reservations"] == {}
    assert lazily["tiers"]["host"]["evictable_pages"] == 2
    assert lazily["tiers"]["host"]["evictions"] == {"aborted": 2}
    led.check_invariants()
    # A second call now knows the session as expired, not unknown.
    with pytest.raises(FailedPrecondition, match="expired or was closed"):
        led.heartbeat(a.id, 41.0)


def test_lazy_and_swept_session_expiry_agree(make_ledger, descriptor, key, store, snapshot):
    def history():
        led = make_ledger(8)
        s = led.register_session("a", descriptor(), 0.0)
        store(led, s.id, [key(1), key(2)], 0.0)
        led.match(s.id, [key(1)], lease=True, now=1.0)
        led.reserve(s.id, [key(5)], 2.0)
        return led, s

    swept, s1 = history()
    lazy, s2 = history()
    swept.expire(40.0)
    with pytest.raises(FailedPrecondition):
        lazy.heartbeat(s2.id, 40.0)
    a, b = snapshot(swept), snapshot(lazy)
    assert a == b


def test_heartbeat_extends_the_session(make_ledger, descriptor):
    led = make_ledger()
    s = led.register_session("a", descriptor(), 0.0)
    assert s.expires_at == 30.0
    led.heartbeat(s.id, 20.0)
    assert s.expires_at == 50.0
    assert led.expire(45.0).sessions == []
    led.heartbeat(s.id, 45.0)                     # after the first deadline: still fine
    assert led.expire(75.0).sessions == []
    assert led.expire(75.5).sessions == [s.id]


@pytest.mark.parametrize("call", ["match", "reserve", "commit", "release"])
def test_every_call_counts_as_a_heartbeat(make_ledger, descriptor, key, store, call):
    led = make_ledger()
    s = led.register_session("a", descriptor(), 0.0)
    store(led, s.id, [key(1)], 0.0)
    lid = led.match(s.id, [key(1)], lease=True, now=0.0).lease_id
    rid = led.reserve(s.id, [key(2)], 0.0).reservation_id
    {"match": lambda: led.match(s.id, [key(1)], lease=False, now=25.0),
     "reserve": lambda: led.reserve(s.id, [key(9)], 25.0),
     "commit": lambda: led.commit(s.id, rid, 25.0),
     "release": lambda: led.release(s.id, lid, 25.0)}[call]()
    assert s.expires_at == 55.0
    assert led.expire(50.0).sessions == []


def test_heartbeats_do_not_extend_reservations(make_ledger, descriptor, key):
    led = make_ledger()
    s = led.register_session("a", descriptor(), 0.0)
    r = led.reserve(s.id, [key(1), key(2)], 0.0)
    assert r.expires_at == 60.0
    for t in (20.0, 40.0, 60.0):
        led.heartbeat(s.id, t)
    assert led.expire(60.0).reservations == []    # at the deadline: still open
    report = led.expire(61.0)
    assert report.sessions == [] and report.reservations == [r.reservation_id]
    assert led.reservations_timed_out == 1
    assert led.top.used_pages == 2 and led.top.free_pages == 6   # cooling till 120
    assert led.top.evictions["reservation_timeout"] == 2
    assert s.reservations == set() and s.id in led.sessions
    with pytest.raises(FailedPrecondition, match="timed out after 60s"):
        led.commit(s.id, r.reservation_id, 61.0)
    led.check_invariants()


def test_a_reservation_past_its_deadline_cannot_commit_before_the_sweep(make_ledger, descriptor,
                                                                        key):
    """Whether expire() ran in between must not decide if a late commit succeeds."""
    led = make_ledger()
    s = led.register_session("a", descriptor(), 0.0)
    r = led.reserve(s.id, [key(1)], 0.0)
    led.heartbeat(s.id, 25.0)
    led.heartbeat(s.id, 50.0)
    with pytest.raises(FailedPrecondition, match="timed out"):
        led.commit(s.id, r.reservation_id, 61.0)
    assert led.block(s.ns.id, key(1)) is None and led.top.used_pages == 1   # cooling
    assert led.reservations_timed_out == 1
    assert led.expire(61.0) == ExpiryReport()
    assert led.match(s.id, [key(1)], lease=False, now=61.0).matched == 0
    led.check_invariants()


def test_a_commit_at_the_deadline_is_in_time(make_ledger, descriptor, key):
    led = make_ledger()
    s = led.register_session("a", descriptor(), 0.0)
    r = led.reserve(s.id, [key(1)], 0.0)
    led.heartbeat(s.id, 25.0)
    led.heartbeat(s.id, 50.0)
    assert led.commit(s.id, r.reservation_id, 60.0) == 1


def test_expire_report_lists_sessions_and_timed_out_reservations(make_ledger, descriptor, key):
    led = make_ledger(16)
    a = led.register_session("a", descriptor(), 0.0)        # will lapse
    b = led.register_session("b", descriptor(), 0.0)        # kept alive
    c = led.register_session("c", descriptor(), 0.0)        # will lapse
    ra = led.reserve(a.id, [key(1)], 0.0).reservation_id
    rb_old = led.reserve(b.id, [key(2)], 0.0).reservation_id
    for t in (25.0, 50.0):
        led.heartbeat(b.id, t)
    rb_new = led.reserve(b.id, [key(3)], 50.0).reservation_id
    report = led.expire(70.0)
    assert sorted(report.sessions) == sorted([a.id, c.id])
    assert report.reservations == [rb_old]                  # ra left with a; rb_new is fresh
    assert ra not in led.reservations and rb_new in led.reservations
    assert led.sessions_expired == 2 and led.reservations_timed_out == 1
    assert set(led.sessions) == {b.id}
    led.check_invariants()


def test_expired_and_closed_sessions_free_their_namespace_count(make_ledger, descriptor):
    led = make_ledger()
    a = led.register_session("a", descriptor(), 0.0)
    b = led.register_session("b", descriptor(), 0.0)
    assert a.ns is b.ns and a.ns.sessions == 2
    led.close_session(b.id, 1.0)
    assert a.ns.sessions == 1 and led.sessions_expired == 0
    led.expire(100.0)
    assert a.ns.sessions == 0 and led.sessions_expired == 1


def test_pages_the_daemon_took_back_stay_out_of_use_until_a_late_writer_is_past(
        make_ledger, descriptor, key):
    """A writer frozen mid-copy (SIGSTOP, a swap storm) past its reservation's
    timeout or its session's expiry goes on writing its pages when it wakes:
    they must not hold another client's acknowledged blocks by then. Pages of
    a reservation its client aborted, or of a session its client closed, are
    free at once."""
    led = make_ledger(4)
    a = led.register_session("a", descriptor(), 0.0)
    b = led.register_session("b", descriptor(), 0.0)
    led.reserve(a.id, [key(1), key(2)], 0.0)              # a freezes with these
    led.heartbeat(b.id, 25.0)
    led.heartbeat(b.id, 50.0)
    assert led.expire(61.0).sessions == [a.id]             # no heartbeat: gone at 30
    assert led.top.free_pages == 2                         # its 2 pages are not handed out
    r = led.reserve(b.id, [key(3), key(4)], 61.0)
    with pytest.raises(ResourceExhausted):                 # the cooling pages are not room
        led.reserve(b.id, [key(5)], 61.0)
    cooling = led.top.cooling.page_set()
    assert len(cooling) == 2
    for blk in r.blocks:
        assert not set(iter_pages(blk.pages, 1)) & cooling
    led.commit(b.id, r.reservation_id, 61.0)
    led.heartbeat(b.id, 75.0)
    assert led.expire(119.0).thawed_pages == 0
    assert led.expire(120.0).thawed_pages == 2             # its deadline 60 + the timeout 60
    assert led.top.free_pages == 2
    led.check_invariants()


def test_a_client_abort_or_close_frees_its_pages_at_once(make_ledger, descriptor, key):
    led = make_ledger(4)
    a = led.register_session("a", descriptor(), 0.0)
    r = led.reserve(a.id, [key(1), key(2)], 0.0)
    led.abort(a.id, r.reservation_id, 1.0)
    assert led.top.free_pages == 4
    led.reserve(a.id, [key(1), key(2)], 1.0)
    led.close_session(a.id, 2.0)
    assert led.top.free_pages == 4
    led.check_invariants()


@pytest.mark.parametrize("end", ["expire", "revoke"])
def test_a_session_the_daemon_ended_cools_its_reservations_pages(make_ledger, descriptor, key,
                                                                 end):
    led = make_ledger(4)
    a = led.register_session("a", descriptor(), 0.0)
    led.reserve(a.id, [key(1)], 10.0)                      # deadline 70
    if end == "expire":
        assert led.expire(41.0).sessions == [a.id]
    else:
        led.revoke([a.id])
    assert led.top.free_pages == 3
    assert led.expire(129.0).thawed_pages == 0
    assert led.expire(130.0).thawed_pages == 1 and led.top.free_pages == 4
    led.check_invariants()
