"""Ledger.revoke: a reload took a session's model from its token. The session
ends at once (reason "revoked"), its leases and reservations go as on any end,
its watches are told, and its owner learns why on its next call."""
from __future__ import annotations

import pytest

from kvkeeper.server.errors import FailedPrecondition
from kvkeeper.server.ids import LOCAL, Identity, SessionId

T = LOCAL   # the owner store() uses; the ledger does not tell identities apart by kind


def test_revoke_ends_the_sessions_named_and_only_those(make_ledger, descriptor, key,
                                                       store) -> None:
    led = make_ledger(8)
    a = led.register_session("a", descriptor("m1"), 0.0, owner=T)
    b = led.register_session("b", descriptor("m2"), 0.0, owner=T)
    store(led, a.id, [key(1), key(2)], 0.0)
    lease = led.match(a.id, [key(1), key(2)], lease=True, now=0.0, owner=T).lease_id
    res = led.reserve(a.id, [key(3)], 0.0, owner=T).reservation_id
    told: list[str] = []
    led.watch(a.id, 0.0, T, told.append)
    assert led.top.evictable_pages == 0
    led.revoke([a.id, SessionId("f-unknown"), a.id])   # an id gone, or repeated, is skipped
    assert a.id not in led.sessions and b.id in led.sessions
    assert lease not in led.leases and res not in led.reservations
    assert told == ["revoked"] and led.session_ends["revoked"] == 1
    # The blocks stay (released, not discarded) for the tokens that still cover the model.
    assert led.block(a.ns.id, key(1)).refs == 0 and led.top.evictable_pages == 2
    led.check_invariants()
    with pytest.raises(FailedPrecondition, match="no longer covers its model"):
        led.heartbeat(a.id, 1.0, T)
    led.heartbeat(b.id, 1.0, T)
    # Another identity holding the revoked id learns nothing of it.
    with pytest.raises(Exception) as e:
        led.heartbeat(a.id, 1.0, Identity("token:other"))
    assert "no longer covers" not in str(e.value)
