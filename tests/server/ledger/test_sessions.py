"""Sessions belong to the identity that registered them, and only successful
calls renew them. Another identity cannot tell a live session of someone else
from an ended one or from an id nobody issued: same error class, same text."""
from __future__ import annotations

import pytest

from kvkeeper.server.errors import FailedPrecondition, InvalidArgument, NotFound
from kvkeeper.server.ids import Identity
from kvkeeper.server.ledger import sessions
from kvkeeper.server.ledger.sessions import ForeignSession, tag

A, B = Identity("token:a"), Identity("token:b")


def failure(call) -> BaseException:
    with pytest.raises(Exception) as info:
        call()
    return info.value


def shape(exc: BaseException, sid: str) -> tuple[type, str]:
    """The class a caller can see (the wire code) and the text with the id blanked."""
    visible = NotFound if isinstance(exc, NotFound) else type(exc)
    return visible, str(exc).replace(repr(sid), "<sid>")


@pytest.fixture
def two(make_ledger, descriptor, key):
    led = make_ledger(8)
    a = led.register_session("a", descriptor(), 0.0, owner=A)
    b = led.register_session("b", descriptor(), 0.0, owner=B)
    r = led.reserve(a.id, [key(1)], 0.0, owner=A)
    led.commit(a.id, r.reservation_id, 0.0, owner=A)
    lease = led.match(a.id, [key(1)], lease=True, now=0.0, owner=A).lease_id
    res = led.reserve(a.id, [key(2)], 0.0, owner=A).reservation_id
    return led, a, b, lease, res


def test_another_identity_gets_the_unknown_answer_on_every_call(two, key, snapshot) -> None:
    led, a, b, lease, res = two
    before = snapshot(led)
    calls = {
        "heartbeat": lambda sid: led.heartbeat(sid, 1.0, B),
        "close": lambda sid: led.close_session(sid, 1.0, B),
        "match": lambda sid: led.match(sid, [key(1)], lease=True, now=1.0, owner=B),
        "lease": lambda sid: led.lease(sid, lease, 1.0, B),
        "release": lambda sid: led.release(sid, lease, 1.0, discard=True, owner=B),
        "reserve": lambda sid: led.reserve(sid, [key(3)], 1.0, owner=B),
        "reservation": lambda sid: led.reservation(sid, res, 1.0, B),
        "commit": lambda sid: led.commit(sid, res, 1.0, owner=B),
        "abort": lambda sid: led.abort(sid, res, 1.0, B),
    }
    never = "7-0123456789abcdef"
    for name, call in calls.items():
        foreign, unknown = failure(lambda: call(a.id)), failure(lambda: call(never))
        assert isinstance(foreign, ForeignSession), name
        assert shape(foreign, a.id) == shape(unknown, never), name
    assert snapshot(led) == before
    # The owner still holds everything.
    assert led.lease(a.id, lease, 1.0, A).blocks[0].key == key(1)
    assert led.commit(a.id, res, 1.0, owner=A) == 1


def test_ended_sessions_are_told_only_to_their_owner(two) -> None:
    led, a, b, *_ = two
    led.close_session(a.id, 1.0, A)
    with pytest.raises(FailedPrecondition, match="expired or was closed"):
        led.heartbeat(a.id, 1.0, A)
    never = "9-0123456789abcdef"
    assert shape(failure(lambda: led.heartbeat(a.id, 1.0, B)), a.id) == \
        shape(failure(lambda: led.heartbeat(never, 1.0, B)), never)
    # An id shaped like an issued one, never issued: NotFound, as any other.
    with pytest.raises(NotFound):
        led.heartbeat(f"1-{'0' * 16}", 1.0, A)


def test_a_failing_call_does_not_renew_the_session(two, key) -> None:
    led, a, _, lease, res = two
    deadline = led.sessions[a.id].expires_at
    for call in (lambda: led.match(a.id, [b"short"], lease=False, now=20.0, owner=A),
                 lambda: led.release(a.id, lease, 20.0, discard_indices=[9], owner=A),
                 lambda: led.reserve(a.id, [key(5), key(5)], 20.0, owner=A),
                 lambda: led.commit(a.id, res, 20.0, checksums=[1, 2, 3], owner=A),
                 lambda: led.release(a.id, 999, 20.0, owner=A)):
        with pytest.raises((InvalidArgument, NotFound)):
            call()
        assert led.sessions[a.id].expires_at == deadline
    led.match(a.id, [key(1)], lease=False, now=20.0, owner=A)
    assert led.sessions[a.id].expires_at == 20.0 + led.config.lease_ttl_s


def test_lookups_alone_renew_nothing(two) -> None:
    led, a, _, lease, res = two
    deadline = led.sessions[a.id].expires_at
    led.lease(a.id, lease, 10.0, A)
    led.reservation(a.id, res, 10.0, A)
    led.session(a.id, 10.0, A)
    assert led.sessions[a.id].expires_at == deadline


def test_tag_is_the_non_secret_counter() -> None:
    assert tag("1a-0123456789abcdef") == "s1a"
    assert tag("y" * 20000) == "s?"
    assert tag("") == "s?"


def test_the_memory_of_ended_sessions_is_bounded(make_ledger, descriptor, monkeypatch) -> None:
    monkeypatch.setattr(sessions, "ENDED_MEMORY", 8)
    led = make_ledger(4)
    ids = []
    for _ in range(8 + 3):
        s = led.register_session("x", descriptor(), 0.0, owner=A)
        ids.append(s.id)
        led.close_session(s.id, 0.0, A)
    with pytest.raises(NotFound):          # forgotten: now it reads as unknown
        led.heartbeat(ids[0], 0.0, A)
    with pytest.raises(FailedPrecondition):
        led.heartbeat(ids[-1], 0.0, A)
    assert len(led.sessions) == 0
