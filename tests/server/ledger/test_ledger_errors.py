"""Each bad input raises its own typed error with a message that says what to do,
and leaves the ledger exactly as it was (full snapshot compare).

A failing call renews nothing (test_sessions.py shows it at other times); the
calls here use the time of the last successful call (T) all the same.
"""
from __future__ import annotations

import pytest

from kvkeeper.server.errors import (ClientError, FailedPrecondition, InvalidArgument, NotFound,
                                    ResourceExhausted)
from kvkeeper.server.ledger import BlockState, SlotStatus

T = 5.0


@pytest.fixture
def env(make_ledger, descriptor, key, store):
    """A ledger with two sessions, a committed chain, a lease and an open reservation."""
    led = make_ledger(6, max_keys_per_call=4)
    a = led.register_session("a", descriptor(), T)
    b = led.register_session("b", descriptor(), T)
    store(led, a.id, [key(1), key(2)], T)
    lease = led.match(a.id, [key(1), key(2)], lease=True, now=T).lease_id
    res = led.reserve(a.id, [key(3)], T).reservation_id
    return led, a, b, lease, res


@pytest.fixture
def unchanged(env, snapshot):
    """Asserts after the test body that nothing in the ledger moved."""
    led = env[0]
    before = snapshot(led)
    yield
    assert snapshot(led) == before
    led.check_invariants()


def raises(exc, fn, *args, **kw) -> str:
    with pytest.raises(exc) as info:
        fn(*args, **kw)
    assert type(info.value) is exc, f"expected exactly {exc.__name__}, got {type(info.value).__name__}"
    return str(info.value)


# ------------------------------------------------------------------ keys
@pytest.mark.usefixtures("unchanged")
@pytest.mark.parametrize("op", ["match", "reserve"])
@pytest.mark.parametrize("length", [0, 16, 31, 33, 64])
def test_malformed_key_length(env, key, op, length):
    led, a, *_ = env
    keys = [key(7), b"\x01" * length]
    fn = (lambda: led.match(a.id, keys, lease=True, now=T)) if op == "match" else \
        (lambda: led.reserve(a.id, keys, T))
    msg = raises(InvalidArgument, fn)
    assert "key 1" in msg and f"{length} bytes" in msg and "32 bytes" in msg


@pytest.mark.usefixtures("unchanged")
@pytest.mark.parametrize("op", ["match", "reserve"])
@pytest.mark.parametrize("bad", ["x" * 32, 12345, None, [0] * 32, memoryview(b"\x00" * 32)],
                         ids=["str", "int", "none", "list", "memoryview"])
def test_non_bytes_key(env, key, op, bad):
    led, a, *_ = env
    keys = [key(7), key(8), bad]
    fn = (lambda: led.match(a.id, keys, lease=False, now=T)) if op == "match" else \
        (lambda: led.reserve(a.id, keys, T))
    msg = raises(InvalidArgument, fn)
    assert "key 2" in msg and type(bad).__name__ in msg and "bytes" in msg


def test_bytearray_keys_work_like_bytes(env, key):
    led, a, b, *_ = env
    r = led.reserve(b.id, [bytearray(key(1)), bytearray(key(9))], T)
    assert r.statuses == [SlotStatus.PRESENT, SlotStatus.RESERVED]
    led.commit(b.id, r.reservation_id, T)
    m = led.match(b.id, [bytearray(key(1)), bytearray(key(2)), bytearray(key(9))],
                  lease=False, now=T)
    assert m.matched == 3
    assert led.match(b.id, [key(9)], lease=False, now=T).matched == 1
    assert type(led.block(a.ns.id, key(9)).key) is bytes
    led.check_invariants()


@pytest.mark.usefixtures("unchanged")
@pytest.mark.parametrize("op", ["match", "reserve"])
def test_too_many_keys(env, key, op):
    led, a, *_ = env
    keys = [key(10 + i) for i in range(5)]   # max_keys_per_call=4
    fn = (lambda: led.match(a.id, keys, lease=True, now=T)) if op == "match" else \
        (lambda: led.reserve(a.id, keys, T))
    msg = raises(InvalidArgument, fn)
    assert "5 keys" in msg and "at most 4" in msg and "split" in msg


def test_exactly_the_limit_is_fine(env, key):
    led, a, *_ = env
    assert led.match(a.id, [key(1)] * 4, lease=False, now=T).matched == 4


@pytest.mark.usefixtures("unchanged")
def test_duplicate_keys_in_reserve(env, key):
    led, a, *_ = env
    msg = raises(InvalidArgument, led.reserve, a.id, [key(20), key(21), key(20)], T)
    assert "twice" in msg


def test_duplicate_keys_are_fine_in_match(env, key):
    led, a, *_ = env
    m = led.match(a.id, [key(1), key(1)], lease=True, now=T)
    assert m.matched == 2
    assert led.block(a.ns.id, key(1)).refs == 3          # env's lease + twice this one
    led.release(a.id, m.lease_id, T)
    assert led.block(a.ns.id, key(1)).refs == 1
    led.check_invariants()


# ------------------------------------------------------------------ sessions
@pytest.mark.usefixtures("unchanged")
@pytest.mark.parametrize("sid", ["", "nope", "1", "ff-0123456789abcdef", "1-short"])
def test_unknown_session_is_not_found(env, key, sid):
    led = env[0]
    for call in (lambda: led.heartbeat(sid, T),
                 lambda: led.match(sid, [key(1)], lease=True, now=T),
                 lambda: led.reserve(sid, [key(30)], T),
                 lambda: led.release(sid, 1, T),
                 lambda: led.commit(sid, 1, T),
                 lambda: led.abort(sid, 1, T),
                 lambda: led.close_session(sid, T)):
        msg = raises(NotFound, call)
        assert "unknown session" in msg and "RegisterSession" in msg


def test_expired_session_is_failed_precondition_not_not_found(env, key, snapshot):
    led, a, b, lease, res = env
    led.heartbeat(b.id, T + 29)
    led.expire(T + 31)                   # a missed its heartbeat; b did not
    assert a.id not in led.sessions and b.id in led.sessions
    before = snapshot(led)
    for call in (lambda: led.heartbeat(a.id, T + 31),
                 lambda: led.match(a.id, [key(1)], lease=True, now=T + 31),
                 lambda: led.reserve(a.id, [key(30)], T + 31),
                 lambda: led.release(a.id, lease, T + 31),
                 lambda: led.commit(a.id, res, T + 31)):
        msg = raises(FailedPrecondition, call)
        assert a.id in msg and "RegisterSession again" in msg
    assert snapshot(led) == before


def test_closed_session_is_failed_precondition(env, snapshot):
    led, a, *_ = env
    led.close_session(a.id, T)
    before = snapshot(led)
    raises(FailedPrecondition, led.heartbeat, a.id, T)
    raises(FailedPrecondition, led.close_session, a.id, T)
    assert snapshot(led) == before


# ------------------------------------------------------------------ leases
@pytest.mark.usefixtures("unchanged")
@pytest.mark.parametrize("lid", [0, -1, 2, 99])
def test_unknown_lease_is_not_found(env, lid):
    led, a, *_ = env
    msg = raises(NotFound, led.release, a.id, lid, T)
    assert f"unknown lease {lid}" in msg and "Match" in msg


def test_double_release_is_failed_precondition(env, snapshot, key):
    led, a, b, lease, _ = env
    led.release(a.id, lease, T)
    before = snapshot(led)
    msg = raises(FailedPrecondition, led.release, a.id, lease, T)
    assert f"lease {lease}" in msg and "already released" in msg and "exactly once" in msg
    raises(FailedPrecondition, led.release, a.id, lease, T, discard=True)
    assert snapshot(led) == before
    assert led.block(a.ns.id, key(1)).refs == 0         # not pushed below zero


@pytest.mark.usefixtures("unchanged")
def test_lease_of_another_session(env):
    led, a, b, lease, _ = env
    msg = raises(FailedPrecondition, led.release, b.id, lease, T)
    assert "another session" in msg
    raises(FailedPrecondition, led.release, b.id, lease, T, discard=True)


# ------------------------------------------------------------------ reservations
@pytest.mark.usefixtures("unchanged")
@pytest.mark.parametrize("rid", [0, -3, 3, 50])
def test_commit_or_abort_of_an_unknown_reservation_is_not_found(env, rid):
    led, a, *_ = env
    msg = raises(NotFound, led.commit, a.id, rid, T)
    assert f"unknown reservation {rid}" in msg and "ReserveSave" in msg
    raises(NotFound, led.abort, a.id, rid, T)


def test_commit_without_any_reservation_is_not_found(make_ledger, descriptor, snapshot):
    led = make_ledger()
    s = led.register_session("i", descriptor(), 0.0)
    r = led.reserve(s.id, [], 0.0)                       # nothing to reserve: no id issued
    assert r.reservation_id is None and r.statuses == []
    before = snapshot(led)
    raises(NotFound, led.commit, s.id, 1, 0.0)
    raises(NotFound, led.abort, s.id, 1, 0.0)
    assert snapshot(led) == before


@pytest.mark.usefixtures("unchanged")
def test_commit_of_an_already_committed_reservation(env):
    led, a, *_ = env
    raises(FailedPrecondition, led.commit, a.id, 1, T)   # env's store() committed rid 1


@pytest.mark.usefixtures("unchanged")
def test_reservation_of_another_session(env):
    led, a, b, _, res = env
    msg = raises(FailedPrecondition, led.commit, b.id, res, T)
    assert "another session" in msg
    raises(FailedPrecondition, led.abort, b.id, res, T)


@pytest.mark.parametrize("end", ["commit", "abort", "timeout"])
def test_commit_after_the_reservation_closed(env, snapshot, key, end):
    led, a, b, _, res = env
    if end == "commit":
        led.commit(a.id, res, T)
    elif end == "abort":
        led.abort(a.id, res, T)
    else:
        led.heartbeat(a.id, T + 25)                       # the session stays alive,
        led.heartbeat(a.id, T + 50)                       # its reservation does not
        assert led.expire(T + 61).reservations == [res]
        assert a.id in led.sessions
    now = T + 61 if end == "timeout" else T
    led.heartbeat(a.id, now)                              # so the failing calls' heartbeat is a no-op
    before = snapshot(led)
    msg = raises(FailedPrecondition, led.commit, a.id, res, now)
    assert f"reservation {res}" in msg and "no longer open" in msg and "reserve again" in msg
    raises(FailedPrecondition, led.abort, a.id, res, now)
    assert snapshot(led) == before
    state = led.block(a.ns.id, key(3))
    assert (state is not None and state.state is BlockState.COMMITTED) == (end == "commit")


@pytest.mark.usefixtures("unchanged")
@pytest.mark.parametrize("n", [2, 5])
def test_wrong_checksum_count(env, n):
    led, a, _, _, res = env
    msg = raises(InvalidArgument, led.commit, a.id, res, T, checksum_algo=1,
                 checksums=list(range(n)))
    assert f"{n} checksums" in msg and "1 keys" in msg and "one per key or none" in msg


def test_reservation_stays_open_after_a_bad_commit(env, key):
    led, a, _, _, res = env
    raises(InvalidArgument, led.commit, a.id, res, T, checksums=[1, 2])
    assert led.commit(a.id, res, T, checksum_algo=2, checksums=[77]) == 1
    assert led.block(a.ns.id, key(3)).checksum == (2, 77)


# ------------------------------------------------------------------ capacity
@pytest.mark.usefixtures("unchanged")
def test_capacity_exhausted(env, key):
    led, a, *_ = env
    # 6 pages: 2 leased + 1 pending = 3 pinned, 3 free, nothing evictable.
    msg = raises(ResourceExhausted, led.reserve, a.id, [key(40 + i) for i in range(4)], T)
    assert "host tier" in msg and "4 blocks needs 4 pages" in msg
    assert "3 are free and 0 evictable (3 pinned" in msg


def test_capacity_exhausted_evicts_nothing(make_ledger, descriptor, key, store, snapshot):
    led = make_ledger(4)
    s = led.register_session("i", descriptor(), 0.0)
    store(led, s.id, [key(1), key(2)])                    # 2 evictable
    led.reserve(s.id, [key(3)], 0.0)                      # 1 pending
    before = snapshot(led)
    msg = raises(ResourceExhausted, led.reserve, s.id, [key(4), key(5), key(6), key(7)], 0.0)
    assert "4 blocks needs 4 pages" in msg
    assert "1 are free" in msg and "2 evictable" in msg and "1 pinned" in msg
    assert snapshot(led) == before
    assert led.top.evictions == {} or sum(led.top.evictions.values()) == 0


# ------------------------------------------------------------------ namespaces
BAD_DESCRIPTORS = [
    (dict(model_id=""), "model_id is empty"),
    (dict(model_id="m" * 257), "model_id is longer than 256"),
    (dict(model_revision="r" * 300), "model_revision is longer"),
    (dict(dtype="d" * 257), "dtype is longer"),
    (dict(kv_layout="é" * 129), "kv_layout is longer"),      # 258 bytes in UTF-8
    (dict(cache_salt="s" * 257), "cache_salt is longer"),
    (dict(lora_tag="l" * 257), "lora_tag is longer"),
    (dict(block_tokens=0), "block_tokens must be positive, got 0"),
    (dict(block_tokens=-16), "block_tokens must be positive, got -16"),
    (dict(block_bytes=0), "block_bytes must be positive, got 0"),
    (dict(tp_size=0), "tp_rank=0 must be in [0, tp_size=0)"),
    (dict(tp_rank=2, tp_size=2), "tp_rank=2 must be in [0, tp_size=2)"),
    (dict(tp_rank=-1, tp_size=2), "tp_rank=-1"),
]


@pytest.mark.parametrize(("fields", "text"), BAD_DESCRIPTORS, ids=[t for _, t in BAD_DESCRIPTORS])
def test_bad_namespace_descriptor(make_ledger, descriptor, snapshot, fields, text):
    led = make_ledger()
    led.register_session("ok", descriptor(), 0.0)
    before = snapshot(led)
    kw = dict(model="m")
    if "model_id" in fields:
        kw["model"] = fields.pop("model_id")
    msg = raises(InvalidArgument, led.register_session, "x", descriptor(**kw, **fields), 0.0)
    assert text in msg and "namespace." in msg
    assert snapshot(led) == before


def test_a_text_field_at_the_limit_is_fine(make_ledger, descriptor):
    led = make_ledger()
    led.register_session("x", descriptor(model="m" * 256, lora_tag="t" * 256), 0.0)


def test_instance_id_too_long(make_ledger, descriptor, snapshot):
    led = make_ledger()
    before = snapshot(led)
    msg = raises(InvalidArgument, led.register_session, "i" * 257, descriptor(), 0.0)
    assert "instance_id" in msg and "256" in msg
    assert snapshot(led) == before


def test_block_larger_than_the_tier(make_ledger, descriptor, snapshot):
    led = make_ledger(4)                                  # 400 B
    before = snapshot(led)
    msg = raises(InvalidArgument, led.register_session, "x", descriptor(block_bytes=401), 0.0)
    assert "401 B" in msg and "does not fit" in msg and "host" in msg and "400 B" in msg
    assert snapshot(led) == before
    led.register_session("x", descriptor(block_bytes=400), 0.0)   # exactly the tier fits


def test_every_ledger_error_is_a_client_error():
    for exc in (InvalidArgument, NotFound, FailedPrecondition, ResourceExhausted):
        assert issubclass(exc, ClientError)
    assert not issubclass(NotFound, FailedPrecondition)
    assert not issubclass(FailedPrecondition, NotFound)


def test_a_run_started_past_another_frees_none_of_its_leases_by_a_stale_id(
        make_ledger, descriptor, key, store, snapshot):
    """A restarted daemon starts its lease ids past the last run's
    (LedgerConfig.first_lease_id): a release sent before the restart and
    retried after it, by id alone, names no lease of the new run."""
    old = make_ledger(6)
    a = old.register_session("a", descriptor(), T)
    store(old, a.id, [key(1)], T)
    stale = old.match(a.id, [key(1)], lease=True, now=T).lease_id
    new = make_ledger(6, first_lease_id=1 << 40)
    s = new.register_session("a", descriptor(), T)
    store(new, s.id, [key(1)], T)
    lease = new.match(s.id, [key(1)], lease=True, now=T).lease_id
    assert lease == 1 << 40 and stale < lease
    before = snapshot(new)
    msg = raises(NotFound, new.release, s.id, stale, T)
    assert f"unknown lease {stale}" in msg
    assert snapshot(new) == before
    new.release(s.id, lease, T)
    assert "already released" in raises(FailedPrecondition, new.release, s.id, lease, T)


def test_each_daemon_run_starts_its_lease_ids_past_the_last_runs() -> None:
    import time

    from kvkeeper.server.config.schema import lease_id_epoch

    first = lease_id_epoch()
    time.sleep(0.002)
    assert lease_id_epoch() >= first + (1 << 20)   # a run can issue 2^20 a millisecond
    assert first < 1 << 63                          # a uint64, and an int64 too


def test_namespaces_nobody_uses_are_forgotten(make_ledger, descriptor, key, store):
    """Registering under ever new cache salts (any token may) does not grow
    the daemon without bound: a namespace with no session and no block is
    dropped once the table has doubled; one with blocks stays (its cache)."""
    from kvkeeper.server.ledger.records import SWEEP_MIN

    led = make_ledger(6)
    kept = led.register_session("k", descriptor(cache_salt="kept"), T)
    store(led, kept.id, [key(1)], T)
    led.close_session(kept.id, T)
    live = led.register_session("l", descriptor(cache_salt="live"), T)
    for i in range(5 * SWEEP_MIN):
        s = led.register_session("x", descriptor(cache_salt=f"salt-{i}"), T)
        led.close_session(s.id, T)
        assert len(led.namespaces) <= 2 * SWEEP_MIN + 2
    assert kept.ns.id in led.namespaces and live.ns.id in led.namespaces
    led.check_invariants()
    # A dropped namespace comes back as new when named again.
    again = led.register_session("x", descriptor(cache_salt="salt-0"), T)
    assert again.ns.sessions == 1 and not again.ns.blocks
