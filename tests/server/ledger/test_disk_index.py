"""The disk tier's index on its own (server/ledger/disk_index.py): no store, no I/O.

Every method that moves an entry is checked both ways: allowed from the states
the table in states.py allows, refused (InvalidTransition, nothing changed)
from every other. Then LRU eviction order, capacity and the invariant checks;
test_disk_index_model.py walks it at random against a model.
"""
from __future__ import annotations

from typing import Any

import pytest

from disk_index_helpers import B, NS, key, lru_order
from kvkeeper.server.errors import InvalidTransition, InvariantViolation, ResourceExhausted
from kvkeeper.server.ledger.disk_index import STORED, WRITING, DiskEntry, DiskIndex
from kvkeeper.server.ledger.states import DiskState

def snapshot(ix: DiskIndex) -> Any:
    """Everything a refused call promises not to change."""
    return ({w: (e.state, e.pins, e.nbytes) for w, e in ix.entries.items()},
            [e.where for e in ix.eviction_order()], ix.used_bytes, ix.evictable_bytes, dict(ix.evictions),
            ix.hit_blocks, ix.written_blocks, ix.written_bytes)


def stored(ix: DiskIndex, i: int, nbytes: int = B) -> DiskEntry:
    res = ix.reserve(NS, key(i), nbytes)
    assert res is not None and res.evicted == []
    ix.written(res.entry)
    return res.entry


def writing(ix: DiskIndex, i: int, nbytes: int = B) -> DiskEntry:
    res = ix.reserve(NS, key(i), nbytes)
    assert res is not None
    return res.entry


def absent(ix: DiskIndex, i: int) -> DiskEntry:
    """An entry that was stored and has been evicted: back to ABSENT."""
    e = stored(ix, i)
    ix.drop(e, "lost")
    return e


def refused(ix: DiskIndex, call: Any, state: str, event: str) -> InvalidTransition:
    before = snapshot(ix)
    with pytest.raises(InvalidTransition) as info:
        call()
    assert (info.value.state.split(" ")[0], info.value.event) == (state, event)
    assert snapshot(ix) == before
    ix.check_invariants()
    return info.value


# ---------------------------------------------------------------- construction

@pytest.mark.parametrize("cap", [0, -1])
def test_capacity_must_be_positive(cap):
    with pytest.raises(ValueError, match="positive capacity"):
        DiskIndex(cap)


# ---------------------------------------------------------------- reserve / written / failed

def test_reserve_takes_bytes_for_an_invisible_writing_entry():
    ix = DiskIndex(10 * B)
    res = ix.reserve(NS, key(1), B)
    assert res is not None and res.evicted == []
    e = res.entry
    assert e.state is DiskState.WRITING and e.state == WRITING and e.pins == 0
    assert ix.used_bytes == B and ix.evictable_bytes == 0 and len(ix) == 1
    assert ix.get(NS, key(1)) is None                      # writing counts as absent
    ix.check_invariants()


def test_reserve_of_a_key_being_written_or_stored_is_none():
    ix = DiskIndex(10 * B)
    writing(ix, 1)
    stored(ix, 2)
    before = snapshot(ix)
    assert ix.reserve(NS, key(1), B) is None and ix.reserve(NS, key(2), B) is None
    assert snapshot(ix) == before


def test_written_makes_the_entry_stored_visible_and_evictable():
    ix = DiskIndex(10 * B)
    e = writing(ix, 1, 3 * B)
    ix.written(e)
    assert e.state is DiskState.STORED and ix.get(NS, key(1)) is e
    assert ix.evictable_bytes == 3 * B and ix.written_blocks == 1 and ix.written_bytes == 3 * B
    ix.check_invariants()


def test_failed_gives_the_bytes_back_without_counting_an_eviction():
    ix = DiskIndex(10 * B)
    e = writing(ix, 1)
    ix.failed(e)
    assert e.state is DiskState.ABSENT and len(ix) == 0 and ix.used_bytes == 0
    assert sum(ix.evictions.values()) == 0 and ix.written_blocks == 0
    assert ix.reserve(NS, key(1), B) is not None           # the key is free again
    ix.check_invariants()


def test_written_and_failed_are_refused_unless_writing():
    ix = DiskIndex(10 * B)
    s = stored(ix, 1)
    gone = absent(ix, 2)
    for call_of in (ix.written, ix.failed):
        event = call_of.__name__
        refused(ix, lambda: call_of(s), "stored", event)
        refused(ix, lambda: call_of(gone), "absent", event)
    w = writing(ix, 3)
    ix.failed(w)
    refused(ix, lambda: ix.written(w), "absent", "written")  # a write that already failed


def test_refusal_names_the_entry():
    ix = DiskIndex(10 * B)
    s = stored(ix, 0xabcdef)
    err = refused(ix, lambda: ix.written(s), "stored", "written")
    assert err.block == s.label() and NS.hex()[:8] in str(err) and key(0xabcdef).hex()[:16] in str(err)


# ---------------------------------------------------------------- adopt

def test_adopt_records_a_stored_entry_found_on_disk():
    ix = DiskIndex(10 * B)
    e = ix.adopt(NS, key(1), 2 * B)
    assert e is not None and e.state is STORED and ix.get(NS, key(1)) is e
    assert ix.used_bytes == 2 * B and ix.evictable_bytes == 2 * B
    assert ix.written_blocks == 0                          # found, not written by us
    ix.check_invariants()


def test_adopt_of_a_known_key_returns_the_existing_entry_whatever_its_state():
    ix = DiskIndex(10 * B)
    w, s = writing(ix, 1), stored(ix, 2)
    before = snapshot(ix)
    assert ix.adopt(NS, key(1), B) is w and ix.adopt(NS, key(2), 5 * B) is s
    assert snapshot(ix) == before and w.state is WRITING


def test_adopt_over_capacity_is_none_and_changes_nothing():
    ix = DiskIndex(3 * B)
    stored(ix, 1, 2 * B)                                   # evictable, but adopt never evicts
    before = snapshot(ix)
    assert ix.adopt(NS, key(2), 2 * B) is None
    assert snapshot(ix) == before
    assert ix.adopt(NS, key(3), B) is not None             # exactly full is fine
    assert ix.used_bytes == ix.capacity_bytes


# ---------------------------------------------------------------- pin / unpin

def test_pin_takes_the_entry_off_the_eviction_list_and_unpin_puts_it_back_last():
    ix = DiskIndex(10 * B)
    a, b, c = stored(ix, 1), stored(ix, 2), stored(ix, 3)
    ix.pin(a)
    ix.pin(a)
    assert a.pins == 2 and lru_order(ix) == [2, 3] and ix.evictable_bytes == 2 * B
    ix.check_invariants()
    ix.unpin(a)
    assert a.pins == 1 and lru_order(ix) == [2, 3]
    ix.unpin(a)
    assert a.pins == 0 and lru_order(ix) == [2, 3, 1] and ix.evictable_bytes == 3 * B
    assert b.state is c.state is STORED
    ix.check_invariants()


def test_pin_is_refused_unless_stored():
    ix = DiskIndex(10 * B)
    w, gone = writing(ix, 1), absent(ix, 2)
    refused(ix, lambda: ix.pin(w), "writing", "pin")
    refused(ix, lambda: ix.pin(gone), "absent", "pin")


def test_unpin_is_refused_at_zero_pins_and_while_writing():
    ix = DiskIndex(10 * B)
    s, w = stored(ix, 1), writing(ix, 2)
    err = refused(ix, lambda: ix.unpin(s), "stored", "unpin")
    assert "pins=0" in str(err) and "negative" in str(err)
    refused(ix, lambda: ix.unpin(w), "writing", "unpin")


def test_unpin_of_an_entry_dropped_while_pinned_is_allowed_and_links_nothing():
    ix = DiskIndex(10 * B)
    e = stored(ix, 1)
    ix.pin(e)
    ix.drop(e, "corrupt")                                  # the pinned reader found it corrupt
    assert e.state is DiskState.ABSENT and len(ix) == 0 and ix.evictions["corrupt"] == 1
    ix.unpin(e)
    assert e.pins == 0 and e.state is DiskState.ABSENT and lru_order(ix) == []
    assert ix.evictable_bytes == 0
    ix.check_invariants()
    refused(ix, lambda: ix.unpin(e), "absent", "unpin")     # but not below zero


# ---------------------------------------------------------------- touch

def test_touch_counts_a_hit_and_makes_the_entry_most_recently_used():
    ix = DiskIndex(10 * B)
    a, _, _ = stored(ix, 1), stored(ix, 2), stored(ix, 3)
    ix.touch(a)
    assert lru_order(ix) == [2, 3, 1] and ix.hit_blocks == 1
    ix.check_invariants()


def test_touch_of_a_pinned_writing_or_gone_entry_only_counts_the_hit():
    ix = DiskIndex(10 * B)
    p, w, gone = stored(ix, 1), writing(ix, 2), absent(ix, 3)
    stored(ix, 4)
    ix.pin(p)
    before = snapshot(ix)
    for e in (p, w, gone):
        ix.touch(e)
    after = snapshot(ix)
    assert after[5] == before[5] + 3                       # hit_blocks
    assert after[:5] == before[:5] and after[6:] == before[6:]
    assert (p.state, w.state, gone.state) == (STORED, WRITING, DiskState.ABSENT)
    ix.check_invariants()


# ---------------------------------------------------------------- drop

def test_drop_forgets_a_stored_entry_and_counts_the_reason():
    ix = DiskIndex(10 * B)
    e, _ = stored(ix, 1), stored(ix, 2)
    ix.drop(e, "lost")
    assert e.state is DiskState.ABSENT and ix.get(NS, key(1)) is None
    assert ix.used_bytes == B and ix.evictable_bytes == B and lru_order(ix) == [2]
    assert ix.evictions == {"lost": 1}
    ix.check_invariants()


def test_drop_of_a_gone_entry_does_nothing():
    ix = DiskIndex(10 * B)
    e = absent(ix, 1)
    before = snapshot(ix)
    ix.drop(e, "lost")
    assert snapshot(ix) == before


def test_drop_of_a_writing_entry_is_refused():
    ix = DiskIndex(10 * B)
    w = writing(ix, 1)
    refused(ix, lambda: ix.drop(w, "lost"), "writing", "drop")
    ix.written(w)                                          # the write goes on unharmed
    assert w.state is STORED


# ---------------------------------------------------------------- eviction order and capacity

def test_reserve_evicts_least_recently_used_unpinned_entries_first():
    ix = DiskIndex(4 * B)
    a, b, c, d = (stored(ix, i) for i in range(4))
    ix.touch(a)                                            # order: b c d a
    ix.pin(c)                                              # order: b d a
    res = ix.reserve(NS, key(9), 2 * B)
    assert res is not None and res.evicted == [b.where, d.where]
    assert b.state is d.state is DiskState.ABSENT and c.state is a.state is STORED
    assert ix.evictions == {"capacity": 2} and ix.used_bytes == 4 * B
    assert lru_order(ix) == [0]
    ix.check_invariants()


def test_reserve_evicts_only_as_much_as_it_needs():
    ix = DiskIndex(4 * B)
    for i in range(3):
        stored(ix, i)
    res = ix.reserve(NS, key(9), 2 * B)                    # one free, one evicted
    assert res is not None and res.evicted == [(NS, key(0))]
    assert ix.used_bytes == ix.capacity_bytes


def test_reserve_that_cannot_fit_even_after_evicting_everything_changes_nothing():
    ix = DiskIndex(4 * B)
    p = stored(ix, 1, 2 * B)
    stored(ix, 2)
    ix.pin(p)                                              # 1 free + 1 evictable < 3
    before = snapshot(ix)
    with pytest.raises(ResourceExhausted, match="does not fit"):
        ix.reserve(NS, key(9), 3 * B)
    assert snapshot(ix) == before
    res = ix.reserve(NS, key(9), 2 * B)                    # 1 free + 1 evictable = 2: fits
    assert res is not None and res.evicted == [(NS, key(2))]
    ix.check_invariants()


def test_writing_entries_are_never_evicted():
    ix = DiskIndex(2 * B)
    writing(ix, 1)
    writing(ix, 2)
    with pytest.raises(ResourceExhausted):
        ix.reserve(NS, key(3), B)


def test_evict_unpinned_empties_the_list_in_lru_order_and_spares_pinned_and_writing():
    ix = DiskIndex(10 * B)
    a, b, c = stored(ix, 1), stored(ix, 2), stored(ix, 3)
    w = writing(ix, 4)
    ix.touch(a)
    ix.pin(b)
    assert ix.evict_unpinned() == [c.where, a.where]
    assert ix.evictions == {"admin": 2} and lru_order(ix) == []
    assert set(ix.entries) == {b.where, w.where} and ix.evictable_bytes == 0
    assert ix.evict_unpinned("drain") == [] and "drain" not in ix.evictions
    ix.check_invariants()


# ---------------------------------------------------------------- invariants

@pytest.mark.parametrize("damage", ["used", "evictable", "absent-in-entries", "pinned-writing",
                                    "lru", "misfiled"])
def test_check_invariants_catches_broken_bookkeeping(damage):
    ix = DiskIndex(10 * B)
    s, w = stored(ix, 1), writing(ix, 2)
    ix.check_invariants()
    if damage == "used":
        ix.used_bytes += 1
    elif damage == "evictable":
        ix.evictable_bytes -= 1
    elif damage == "absent-in-entries":
        w.state = DiskState.ABSENT
    elif damage == "pinned-writing":
        w.pins = 1
    elif damage == "lru":
        s.pins = 1                                         # pinned behind the list's back
    else:
        ix.entries[(NS, key(7))] = ix.entries.pop(s.where)
    with pytest.raises(InvariantViolation):
        ix.check_invariants()


# ------------------------------------------------------------------ admission
def fill_book(policy: str, n: int = 3) -> DiskIndex:
    d = DiskIndex(n * B, policy)
    for i in range(n):
        d.written(d.reserve(NS, key(i), B).entry)
    return d


def test_s3fifo_turns_a_cold_copy_away_from_a_full_book_once():
    """A block never hit above (a one-off long document) does not displace a full
    disk on its first arrival; when it comes again it does; a hit one at once."""
    d = fill_book("s3fifo")
    before = (sorted(d.entries), d.used_bytes, dict(d.evictions))
    assert d.reserve(NS, key(10), B) is None and d.refused == 1
    assert (sorted(d.entries), d.used_bytes, dict(d.evictions)) == before
    again = d.reserve(NS, key(10), B)
    assert again is not None and len(again.evicted) == 1
    d.written(again.entry)
    assert d.reserve(NS, key(11), B, hits=2) is not None
    d.check_invariants()


@pytest.mark.parametrize("policy", ["lru", "hits-lru"])
def test_recency_policies_admit_every_copy(policy):
    d = fill_book(policy)
    r = d.reserve(NS, key(10), B)
    assert r is not None and len(r.evicted) == 1 and d.refused == 0


def test_a_book_with_room_admits_without_asking():
    d = DiskIndex(4 * B, "s3fifo")
    assert d.reserve(NS, key(1), B) is not None and d.refused == 0


@pytest.mark.parametrize("policy", ["lru", "hits-lru", "s3fifo"])
def test_demote_puts_a_stored_copy_first_and_leaves_busy_ones_alone(policy: str) -> None:
    """A last turn's copies go first in line; one being written or read (pinned)
    keeps its place and is not counted; a hit afterwards undoes it."""
    ix = DiskIndex(10 * B, policy)
    entries = [stored(ix, i) for i in range(4)]
    ix.demote(entries[2])
    assert lru_order(ix)[0] == 2 and ix.last_turn_demoted == 1
    ix.pin(entries[3])
    busy = writing(ix, 7)
    before = snapshot(ix)
    ix.demote(entries[3])                      # being read
    ix.demote(busy)                            # being written
    assert snapshot(ix) == before and ix.last_turn_demoted == 1
    ix.unpin(entries[3])
    ix.touch(entries[2])
    assert lru_order(ix)[0] != 2
    ix.check_invariants()
