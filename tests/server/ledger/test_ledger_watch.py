"""Watched sessions: the end of a session's last watch ends the session
(disconnected), a session that ends ends its watches (closed, expired), and a
session nobody watches lives by heartbeats alone, as before."""
from __future__ import annotations

import pytest

from kvkeeper.server.errors import FailedPrecondition, NotFound
from kvkeeper.server.ids import LOCAL, Identity
from kvkeeper.server.ledger.sessions import END_REASONS

A, B = LOCAL, Identity("token:b")   # A: the owner store() uses


class Ends:
    """An on_end callback that records the reasons it was given."""

    def __init__(self) -> None:
        self.reasons: list[str] = []

    def __call__(self, reason: str) -> None:
        self.reasons.append(reason)


@pytest.fixture
def held(make_ledger, descriptor, key, store):
    """Session a holds a lease on two committed blocks and an open
    reservation, and is watched once (t=0)."""
    led = make_ledger(8)
    a = led.register_session("a", descriptor(), 0.0, owner=A)
    store(led, a.id, [key(1), key(2)], 0.0)
    lease = led.match(a.id, [key(1), key(2)], lease=True, now=0.0, owner=A).lease_id
    res = led.reserve(a.id, [key(3)], 0.0, owner=A).reservation_id
    ends = Ends()
    w = led.watch(a.id, 0.0, A, ends)
    return led, a, lease, res, w, ends


def ends_of(led) -> dict[str, int]:
    return {r: led.session_ends[r] for r in END_REASONS}


def test_the_end_of_the_last_watch_ends_the_session_and_frees_its_leases(held, key) -> None:
    led, a, lease, res, w, ends = held
    assert led.top.evictable_pages == 0
    assert led.unwatch(w) is True
    assert a.id not in led.sessions and lease not in led.leases and res not in led.reservations
    assert ends_of(led) == {"closed": 0, "expired": 0, "disconnected": 1, "revoked": 0}
    assert led.sessions_expired == 0
    assert ends.reasons == [], "a watch that ended itself is not told the session ended"
    # Released, not discarded: the blocks stay for the next engine.
    assert led.block(a.ns.id, key(1)).refs == 0 and led.top.evictable_pages == 2
    assert led.block(a.ns.id, key(3)) is None, "the reservation was aborted"
    assert a.ns.sessions == 0
    led.check_invariants()
    # The owner is told its session ended, as after CloseSession.
    with pytest.raises(FailedPrecondition, match="expired or was closed"):
        led.heartbeat(a.id, 1.0, A)


def test_a_session_watched_twice_ends_with_its_last_watch(held) -> None:
    led, a, lease, _, w1, _ = held
    w2 = led.watch(a.id, 1.0, A, Ends())
    assert led.unwatch(w1) is False
    assert a.id in led.sessions and lease in led.leases
    led.check_invariants()
    assert led.unwatch(w1) is False, "a second end of the same watch changes nothing"
    assert a.id in led.sessions
    assert led.unwatch(w2) is True and a.id not in led.sessions
    led.check_invariants()


@pytest.mark.parametrize("how", ["close", "expire", "lazy expiry"])
def test_a_session_that_ends_ends_its_watches(held, how) -> None:
    led, a, lease, _, w, ends = held
    other = Ends()
    led.watch(a.id, 0.0, A, other)
    if how == "close":
        led.close_session(a.id, 1.0, A)
        reason = "closed"
    elif how == "expire":
        assert led.expire(31.0).sessions == [a.id]
        reason = "expired"
    else:
        with pytest.raises(FailedPrecondition, match="expired: no heartbeat"):
            led.match(a.id, [], lease=False, now=31.0, owner=A)
        reason = "expired"
    assert ends.reasons == [reason] and other.reasons == [reason]
    assert ends_of(led)[reason] == 1 and sum(ends_of(led).values()) == 1
    # The watch's call ends after its session: nothing more happens.
    assert led.unwatch(w) is False
    assert ends_of(led)["disconnected"] == 0
    assert lease not in led.leases
    led.check_invariants()


def test_a_session_nobody_watches_lives_by_heartbeats_alone(make_ledger, descriptor, key,
                                                            store) -> None:
    led = make_ledger(8)
    a = led.register_session("a", descriptor(), 0.0)
    store(led, a.id, [key(1)], 0.0)
    lease = led.match(a.id, [key(1)], lease=True, now=0.0).lease_id
    # Another session's watch ending takes nothing of a's.
    b = led.register_session("b", descriptor(), 0.0)
    assert led.unwatch(led.watch(b.id, 0.0, A, Ends())) is True
    assert led.expire(29.0).sessions == [] and lease in led.leases
    led.heartbeat(a.id, 29.0)
    assert led.expire(58.0).sessions == [] and lease in led.leases
    assert led.expire(59.5).sessions == [a.id] and lease not in led.leases
    assert ends_of(led) == {"closed": 0, "expired": 1, "disconnected": 1, "revoked": 0}
    led.check_invariants()


def test_watching_renews_the_session(held) -> None:
    led, a, *_ = held
    led.watch(a.id, 20.0, A, Ends())
    assert led.expire(45.0).sessions == [] and a.id in led.sessions
    assert led.expire(50.5).sessions == [a.id]


def test_watching_a_session_one_cannot_name_changes_nothing(held, snapshot) -> None:
    led, a, *_ = held
    before = snapshot(led)
    with pytest.raises(NotFound):
        led.watch(a.id, 1.0, B, Ends())               # another identity's
    with pytest.raises(NotFound):
        led.watch("7-0123456789abcdef", 1.0, A, Ends())   # never issued
    assert snapshot(led) == before
    assert len(a.watches) == 1
    led.close_session(a.id, 1.0, A)
    with pytest.raises(FailedPrecondition, match="expired or was closed"):
        led.watch(a.id, 1.0, A, Ends())               # ended
    led.check_invariants()


def test_the_old_sessions_watch_ending_leaves_the_new_session_alone(held, descriptor) -> None:
    """A client that registered again (its session expired) and whose old
    watch ends only then keeps its new session."""
    led, a, _, _, w, _ = held
    led.expire(31.0)
    again = led.register_session("a", descriptor(), 31.0, owner=A)
    led.watch(again.id, 31.0, A, Ends())
    assert led.unwatch(w) is False
    assert again.id in led.sessions
    led.check_invariants()
