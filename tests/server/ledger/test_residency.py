"""The gpu tier's books (ledger/residency.py, routing.py) and the event log (events.py)."""
from __future__ import annotations

import pytest

from kvkeeper.server.errors import FailedPrecondition, InvalidArgument, NotFound, OutOfRange
from kvkeeper.server.ids import DISK, GPU, HOST, Identity
from kvkeeper.server.ledger.events import CLEARED, REMOVED, STORED, EventLog
from kvkeeper.server.ledger.residency import Change, engine_of



K1 = (1).to_bytes(32, "big")


def _books(led):  # what a failed call must leave as it was
    return ({sid: (dict(b.blocks), b.capacity_blocks, b.report_seq, b.overflow)
             for sid, b in led.residency.books.items()}, led.residency.log.last_seq)


def _commit(led, sid, keys, now=0.0):
    r = led.reserve(sid, keys, now=now)
    led.commit(sid, r.reservation_id, now)


def test_a_report_fills_the_engines_book_and_locate_names_its_prefix(
        make_ledger, descriptor, key) -> None:
    led = make_ledger()
    a = led.register_session("engine a", descriptor(), 0.0).id
    b = led.register_session("engine b", descriptor(), 0.0).id
    ks = [key(i) for i in range(6)]
    led.report_residency(a, [Change(STORED, ks[:4])], 1.0, capacity_blocks=10)
    led.report_residency(b, [Change(STORED, ks[:2] + ks[3:5])], 1.0, capacity_blocks=10)
    _commit(led, a, ks[:3])
    ns = led.sessions[a].ns.id
    p = led.locate_chain(ns, ks)
    assert [(e.engine, e.prefix) for e in p.engines] == [(engine_of(a), 4), (engine_of(b), 2)]
    assert p.engines[0].instance_id == "engine a"
    assert p.engines[0].resident_blocks == 4 and p.engines[0].capacity_blocks == 10
    assert p.tiers == [(HOST, 3)] and p.stored == 3
    led.check_invariants()


def test_removed_and_cleared_drop_blocks_and_locate_names_nobody_after_a_clear(
        make_ledger, descriptor, key) -> None:
    led = make_ledger()
    a = led.register_session("a", descriptor(), 0.0).id
    ks = [key(i) for i in range(4)]
    led.report_residency(a, [Change(STORED, ks)], 0.0, capacity_blocks=8)
    ns = led.sessions[a].ns.id
    led.report_residency(a, [Change(REMOVED, [ks[1], key(99)])], 0.0)
    assert led.locate_chain(ns, ks).engines[0].prefix == 1
    led.report_residency(a, [Change(CLEARED)], 0.0)
    assert led.locate_chain(ns, ks).engines[0].prefix == 0
    kinds = [(e.kind, e.keys) for e in led.residency.log.since(0).events]
    # Removing a key the book lacks is nothing: only ks[1] is in the removed event.
    assert kinds == [(STORED, tuple(ks)), (REMOVED, (ks[1],)), (CLEARED, ())]
    led.check_invariants()


def test_changes_apply_in_order_within_one_report(make_ledger, descriptor, key) -> None:
    led = make_ledger()
    a = led.register_session("a", descriptor(), 0.0).id
    ks = [key(i) for i in range(3)]
    led.report_residency(a, [Change(STORED, ks), Change(CLEARED), Change(STORED, ks[2:])], 0.0,
                         capacity_blocks=8)
    assert list(led.residency.books[a].blocks) == [ks[2]]


def test_a_book_holds_at_most_its_capacity_the_oldest_leave(make_ledger, descriptor, key) -> None:
    led = make_ledger()
    a = led.register_session("a", descriptor(), 0.0).id
    ks = [key(i) for i in range(5)]
    led.report_residency(a, [Change(STORED, ks[:3])], 0.0, capacity_blocks=3)
    led.report_residency(a, [Change(STORED, [ks[0]])], 0.0)   # re-stored: the newest now
    r = led.report_residency(a, [Change(STORED, ks[3:])], 0.0)
    book = led.residency.books[a]
    assert list(book.blocks) == [ks[0], ks[3], ks[4]] and r.resident_blocks == 3
    assert book.overflow == 2
    last = led.residency.log.since(0).events[-1]
    assert (last.kind, last.keys) == (REMOVED, (ks[1], ks[2]))
    led.check_invariants()


def test_a_repeated_report_seq_is_ignored(make_ledger, descriptor, key) -> None:
    led = make_ledger()
    a = led.register_session("a", descriptor(), 0.0).id
    assert led.report_residency(a, [Change(STORED, [key(1)])], 0.0, capacity_blocks=4,
                                report_seq=1).applied
    r = led.report_residency(a, [Change(CLEARED)], 0.0, report_seq=1)
    assert not r.applied and r.resident_blocks == 1
    assert led.report_residency(a, [Change(CLEARED)], 0.0, report_seq=2).resident_blocks == 0


@pytest.mark.parametrize("changes, capacity, what", [
    ([Change(STORED, [K1])], 0, "capacity_blocks"),
    ([Change("moved", [K1])], 4, "kind"),
    ([Change(CLEARED, [K1])], 4, "names no keys"),
    ([Change(STORED, [K1], [0, 1])], 4, "block_ids"),
    ([Change(REMOVED, [K1], [0])], 4, "block_ids"),
    ([Change(STORED, [K1], [4])], 4, "outside"),
    ([Change(STORED, [K1]), Change(STORED, [b"short"])], 4, "32 bytes"),
    ([Change(STORED, [K1])], 1 << 40, "capacity_blocks"),
])
def test_a_bad_report_is_refused_and_changes_nothing(
        changes, capacity, what, make_ledger, descriptor, key) -> None:
    led = make_ledger()
    a = led.register_session("a", descriptor(), 0.0).id
    before = _books(led)
    with pytest.raises(InvalidArgument, match=what):
        led.report_residency(a, changes, 0.0, capacity_blocks=capacity)
    assert _books(led) == before
    led.check_invariants()


def test_reports_need_the_sessions_own_identity(make_ledger, descriptor, key) -> None:
    led = make_ledger()
    a = led.register_session("a", descriptor(), 0.0, owner=Identity("token:a")).id
    with pytest.raises(NotFound):
        led.report_residency(a, [Change(STORED, [key(1)])], 0.0, capacity_blocks=2,
                             owner=Identity("token:b"))
    assert not led.residency.books


@pytest.mark.parametrize("end", ["close", "expire", "disconnect"])
def test_a_session_that_ends_drops_its_book_with_a_cleared_event(
        end, make_ledger, descriptor, key) -> None:
    led = make_ledger(lease_ttl_s=5.0)
    a = led.register_session("a", descriptor(), 0.0).id
    ns = led.sessions[a].ns.id
    led.report_residency(a, [Change(STORED, [key(1)])], 0.0, capacity_blocks=2)
    if end == "close":
        led.close_session(a, 1.0)
    elif end == "expire":
        led.expire(10.0)
    else:
        led.unwatch(led.watch(a, 1.0, led.sessions[a].owner, lambda reason: None))
    assert not led.residency.books and not led.residency.by_namespace
    assert led.locate_chain(ns, [key(1)]).engines == []
    last = led.residency.log.since(0).events[-1]
    assert (last.kind, last.engine, last.tier) == (CLEARED, engine_of(a), GPU)
    with pytest.raises((NotFound, FailedPrecondition)):
        led.report_residency(a, [Change(STORED, [key(1)])], 11.0, capacity_blocks=2)
    led.check_invariants()


def test_gpu_holder_is_the_longest_other_engine(make_ledger, descriptor, key) -> None:
    led = make_ledger()
    a = led.register_session("a", descriptor(), 0.0).id
    b = led.register_session("b", descriptor(), 0.0).id
    c = led.register_session("c", descriptor(), 0.0).id
    other = led.register_session("other model", descriptor(model="n"), 0.0).id
    ks = [key(i) for i in range(4)]
    led.report_residency(a, [Change(STORED, ks)], 0.0, capacity_blocks=8)
    led.report_residency(b, [Change(STORED, ks[:2])], 0.0, capacity_blocks=8)
    holder, n = led.gpu_holder(c, ks)
    assert (holder.engine, n) == (engine_of(a), 4)
    holder, n = led.gpu_holder(a, ks)      # never the caller's own engine
    assert (holder.engine, n) == (engine_of(b), 2)
    assert led.gpu_holder(other, ks) == (None, 0)   # another namespace's keys


def test_locate_of_an_unknown_namespace_answers_nothing_held(make_ledger, descriptor, key) -> None:
    led = make_ledger()
    p = led.locate_chain(b"\x00" * 16, [key(1)])
    assert p.engines == [] and p.tiers == [(HOST, 0)] and p.stored == 0
    with pytest.raises(InvalidArgument):
        led.locate_chain(b"\x00" * 16, [b"short"])


def test_the_event_log_replays_after_a_seq_and_reports_what_it_dropped(key) -> None:
    log = EventLog(capacity_keys=4, epoch="e")
    for i in range(5):
        log.append(GPU, "s1", STORED, b"n" * 16, [key(i), key(i + 10)])
    # 2 keys an event, room for 4: the two newest stay.
    assert (log.first_seq, log.last_seq, log.dropped) == (4, 5, 3)
    r = log.since(1)
    assert r.lost == (2, 3) and [e.seq for e in r.events] == [4, 5]
    r = log.since(4)
    assert r.lost is None and [e.seq for e in r.events] == [5]
    assert log.since(5).events == [] and log.since(5).lost is None
    with pytest.raises(OutOfRange):
        log.since(6)
    assert log.check_invariants() == []


def test_the_newest_event_stays_however_large(key) -> None:
    log = EventLog(capacity_keys=2)
    log.append(GPU, "s1", STORED, b"n" * 16, [key(i) for i in range(5)])
    assert len(log) == 1 and log.since(0).events[0].seq == 1
    assert log.check_invariants() == []


def test_the_host_tier_logs_commits_and_blocks_that_leave(make_ledger, descriptor, key) -> None:
    led = make_ledger(pages=2)
    a = led.register_session("a", descriptor(), 0.0).id
    ns = led.sessions[a].ns.id
    _commit(led, a, [key(0)])
    assert led.residency.log.last_seq == 0     # nobody has watched: nothing logged
    led.reclaim_unpinned()
    led.residency.log.watched = True
    _commit(led, a, [key(1), key(2)])
    _commit(led, a, [key(3)])         # evicts one of the first two (2 pages)
    r = led.reserve(a, [key(4)], now=1.0)
    led.abort(a, r.reservation_id, 1.0)   # never stored: no event
    ev = [(e.tier, e.engine, e.kind, e.keys, e.namespace) for e in led.residency.log.since(0).events]
    assert ev[:2] == [(HOST, "", STORED, (key(1), key(2)), ns), (HOST, "", REMOVED, (key(2),), ns)]
    assert ev[2] == (HOST, "", STORED, (key(3),), ns)
    assert [e[2] for e in ev[3:]] == [REMOVED]    # room for key(4) took key(1)
    led.check_invariants()


def test_a_disk_book_logs_writes_and_removals(make_ledger, key) -> None:
    led = make_ledger()
    led.residency.log.watched = True
    book = led.add_book(DISK, 3 * 100)
    res = book.reserve(b"n" * 16, key(1), 100)
    book.written(res.entry)
    book.adopt(b"n" * 16, key(2), 100)
    book.drop(book.get(b"n" * 16, key(1)), "corrupt")
    ev = [(e.tier, e.kind, e.keys) for e in led.residency.log.since(0).events]
    assert ev == [(DISK, STORED, (key(1),)), (DISK, STORED, (key(2),)), (DISK, REMOVED, (key(1),))]


def test_locate_counts_each_tier_by_itself_and_the_daemon_as_a_whole(
        make_ledger, descriptor, key) -> None:
    led = make_ledger()
    book = led.add_book(DISK, 10 * 100)
    a = led.register_session("a", descriptor(), 0.0).id
    ns = led.sessions[a].ns.id
    _commit(led, a, [key(0)])
    for i in (1, 2, 4):
        book.written(book.reserve(ns, key(i), 100).entry)
    r = book.reserve(ns, key(3), 100)          # being written: not there yet
    p = led.locate_chain(ns, [key(i) for i in range(5)])
    assert p.tiers == [(HOST, 1), (DISK, 0)] and p.stored == 3
    book.written(r.entry)
    p = led.locate_chain(ns, [key(i) for i in range(1, 5)])
    assert p.tiers == [(HOST, 0), (DISK, 4)] and p.stored == 4
