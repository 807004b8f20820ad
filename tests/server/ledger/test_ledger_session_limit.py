"""max_sessions_per_identity: one identity holds at most that many live
sessions; one more is refused with nothing changed, and every way a session
ends gives its room back."""
from __future__ import annotations

import pytest

from kvkeeper.server.errors import ResourceExhausted
from kvkeeper.server.ids import Identity

T, U = Identity("token:t"), Identity("token:u")


def test_one_more_session_than_the_limit_is_refused_and_changes_nothing(
        make_ledger, descriptor, snapshot) -> None:
    led = make_ledger(8, max_sessions_per_identity=2)
    a = led.register_session("a", descriptor("m1"), 0.0, owner=T)
    led.register_session("b", descriptor("m1"), 0.0, owner=T)
    before = snapshot(led)
    with pytest.raises(ResourceExhausted, match="max_sessions_per_identity") as e:
        led.register_session("c", descriptor("m-new"), 0.0, owner=T)
    assert "'token:t' already holds 2 live sessions" in str(e.value)
    assert snapshot(led) == before and len(led.namespaces) == 1, "no namespace was made"
    led.register_session("c", descriptor("m1"), 0.0, owner=U)    # another identity's own room
    led.close_session(a.id, 1.0, T)
    c = led.register_session("c", descriptor("m1"), 1.0, owner=T)
    led.check_invariants()
    # Expiry and revocation give room back too.
    led.revoke([c.id])
    d = led.register_session("d", descriptor("m1"), 1.0, owner=T)
    assert led.expire(100.0).sessions and not led.sessions
    for i in range(2):
        led.register_session(f"e{i}", descriptor("m1"), 100.0, owner=T)
    assert d.id not in led.sessions


def test_zero_means_no_limit(make_ledger, descriptor) -> None:
    led = make_ledger(8, max_sessions_per_identity=0)
    for i in range(50):
        led.register_session(f"s{i}", descriptor(), 0.0, owner=T)
    assert len(led.sessions) == 50
