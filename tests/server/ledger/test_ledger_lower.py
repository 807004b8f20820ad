"""The ledger's books of the tiers below (bytes, keyed by namespace and key) and
the daemon's own holder of pins and reservations."""
from __future__ import annotations

import pytest

from kvkeeper.server.errors import FailedPrecondition
from kvkeeper.server.ids import DISK
from kvkeeper.server.ledger import BlockState


def test_a_lower_book_takes_the_configured_policy(make_ledger, descriptor, key):
    led = make_ledger(8, policy="hits-lru")
    book = led.add_book(DISK, 300)
    ns = led.register_session("a", descriptor(), 0.0).ns
    entries = []
    for i in (1, 2, 3):
        r = book.reserve(ns.id, key(i), 100)
        book.written(r.entry)
        entries.append(r.entry)
    book.touch(entries[0])                 # the oldest, but hit: hits-lru keeps it
    r = book.reserve(ns.id, key(4), 100)
    assert r.evicted == [(ns.id, key(2))]
    book.written(r.entry)
    led.check_invariants()
    with pytest.raises(ValueError):
        led.add_book(DISK, 300)            # one book per tier


def test_lru_book_evicts_the_least_recently_used(make_ledger, descriptor, key):
    led = make_ledger(8, policy="lru")
    book = led.add_book(DISK, 200)
    ns = led.register_session("a", descriptor(), 0.0).ns
    first = book.reserve(ns.id, key(1), 100).entry
    book.written(first)
    book.written(book.reserve(ns.id, key(2), 100).entry)
    book.touch(first)
    assert book.reserve(ns.id, key(3), 100).evicted == [(ns.id, key(2))]


def test_locate_walks_the_tiers_in_order(make_ledger, descriptor, key, store):
    led = make_ledger(8)
    book = led.add_book(DISK, 1000)
    s = led.register_session("a", descriptor(), 0.0)
    store(led, s.id, [key(1)])
    book.written(book.reserve(s.ns.id, key(2), 100).entry)
    located = led.locate(s.ns, [key(1), key(2), key(3), key(1)])
    assert located.tiers == [led.top.name, DISK] and located.probe   # key 3: in no book
    led.reserve(s.id, [key(3)], 0.0)
    located = led.locate(s.ns, [key(1), key(2), key(3)])
    assert located.tiers == [led.top.name, DISK] and not located.probe   # being written


def test_an_evicted_block_with_a_lower_copy_is_demoted(make_ledger, descriptor, key, store):
    led = make_ledger(2)
    book = led.add_book(DISK, 1000)
    s = led.register_session("a", descriptor(), 0.0)
    store(led, s.id, [key(1), key(2)])
    book.written(book.reserve(s.ns.id, key(1), 100).entry)    # key 1 is below too
    store(led, s.id, [key(3), key(4)])                         # evicts both
    assert led.top.evictions == {"demoted": 1, "capacity": 1}
    led.check_invariants()


def test_internal_reservation_and_pins_belong_to_no_session(make_ledger, descriptor, key,
                                                            store):
    led = make_ledger(8)
    s = led.register_session("a", descriptor(), 0.0)
    r = led.reserve_internal(s.ns.id, [key(1), key(2)], 1.0)
    assert r.reservation_id in led.internal.reservations and not s.reservations
    assert led.open_reservations() == 0
    led.check_invariants()
    assert led.commit_internal(r.reservation_id, 2.0) == 2
    lease = led.pin_internal(s.ns, [key(1), key(2), key(3)])
    assert lease is not None and len(lease.blocks) == 2 and lease.id in led.internal.leases
    led.close_session(s.id, 3.0)                      # the daemon's pins outlive sessions
    assert all(b.refs == 1 for b in lease.blocks)
    led.check_invariants()
    led.release_internal(lease, 4.0)
    led.release_internal(lease, 4.0)                  # again: nothing happens
    assert not led.leases and all(b.refs == 0 for b in lease.blocks)
    assert led.pin_internal(s.ns, [key(9)]) is None
    led.check_invariants()


def test_internal_reservations_time_out_and_abort(make_ledger, descriptor, key):
    led = make_ledger(8)
    s = led.register_session("a", descriptor(), 0.0)
    r = led.reserve_internal(s.ns.id, [key(1)], 0.0)
    with pytest.raises(FailedPrecondition):
        led.commit_internal(r.reservation_id, 61.0)
    assert led.block(s.ns.id, key(1)) is None and led.top.evictions["reservation_timeout"] == 1
    r = led.reserve_internal(s.ns.id, [key(1)], 70.0)
    led.abort_internal(r.reservation_id, 71.0)
    assert led.block(s.ns.id, key(1)) is None and led.top.evictions["aborted"] == 1
    assert not led.reservations and not led.internal.reservations
    b = led.register_session("b", descriptor(), 72.0)   # a expired meanwhile: no matter
    assert led.reserve(b.id, [key(1)], 72.0).blocks[0].state is BlockState.PENDING
    led.check_invariants()


def test_due_for_admission_and_adopt(make_ledger, descriptor, key, store):
    led = make_ledger(8)
    led.add_book(DISK, 1000)
    s = led.register_session("a", descriptor(block_bytes=100), 0.0)
    store(led, s.id, [key(1), key(2)])
    for t in (1.0, 2.0):
        led.match(s.id, [key(1)], lease=False, now=t)
    assert led.due_for_admission(DISK, s.ns, [key(1), key(2)], 2) == [key(1)]
    assert not led.adopt(DISK, s.ns, key(1), 99)        # not this namespace's block size
    assert led.adopt(DISK, s.ns, key(1), 100)
    assert led.due_for_admission(DISK, s.ns, [key(1), key(2)], 2) == []
    led.check_invariants()
