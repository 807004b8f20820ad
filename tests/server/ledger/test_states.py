"""The lifecycle transition tables (server/ledger/states.py): blocks, disk entries."""
from __future__ import annotations

import itertools

import pytest

from kvkeeper.server.errors import ClientError, FailedPrecondition, InvalidTransition
from kvkeeper.server.ledger.states import (DISK_REQUIRES_UNPINNED, DISK_TRANSITIONS,
                                           REQUIRES_UNREFERENCED, TRANSITIONS, BlockState,
                                           DiskEvent, DiskState, Event, next_disk_state,
                                           next_state)

S, E = BlockState, Event
DS, DE = DiskState, DiskEvent

EXPECTED = {
    (S.ABSENT, E.RESERVE): S.PENDING,
    (S.PENDING, E.COMMIT): S.COMMITTED,
    (S.PENDING, E.ABORT): S.RECLAIMED,
    (S.PENDING, E.TIMEOUT): S.RECLAIMED,
    (S.COMMITTED, E.PIN): S.COMMITTED,
    (S.COMMITTED, E.UNPIN): S.COMMITTED,
    (S.COMMITTED, E.EVICT): S.EVICTED,
    (S.COMMITTED, E.RECLAIM): S.RECLAIMED,
}
INVALID = [pair for pair in itertools.product(S, E) if pair not in EXPECTED]


def test_table_is_exactly_the_documented_lifecycle():
    assert TRANSITIONS == EXPECTED
    assert REQUIRES_UNREFERENCED == {E.EVICT, E.RECLAIM}


@pytest.mark.parametrize(("state", "event"), sorted(EXPECTED, key=str))
def test_valid_transitions_return_the_next_state(state, event):
    refs = 1 if event is E.UNPIN else 0
    assert next_state("blk", state, event, refs) is EXPECTED[(state, event)]


def test_every_pair_is_either_valid_or_invalid():
    assert len(INVALID) + len(EXPECTED) == len(S) * len(E)
    assert len(INVALID) == 32


@pytest.mark.parametrize(("state", "event"), INVALID, ids=lambda v: v.name)
def test_invalid_pair_raises_naming_block_state_and_event(state, event):
    with pytest.raises(InvalidTransition) as info:
        next_state("ns01/abcdef", state, event)
    err = info.value
    assert (err.block, err.state, err.event) == ("ns01/abcdef", state.value, event.value)
    msg = str(err)
    assert "ns01/abcdef" in msg and repr(state.value) in msg and repr(event.value) in msg


@pytest.mark.parametrize("state", [S.EVICTED, S.RECLAIMED])
def test_terminal_states_accept_no_event(state):
    for event in E:
        with pytest.raises(InvalidTransition):
            next_state("b", state, event)


def test_invalid_transition_is_a_failed_precondition_client_error():
    assert issubclass(InvalidTransition, FailedPrecondition)
    assert issubclass(InvalidTransition, ClientError)


@pytest.mark.parametrize("event", [E.EVICT, E.RECLAIM])
@pytest.mark.parametrize("refs", [1, 2, 7])
def test_evict_and_reclaim_of_a_referenced_block_are_rejected(event, refs):
    with pytest.raises(InvalidTransition) as info:
        next_state("b1", S.COMMITTED, event, refs)
    msg = str(info.value)
    assert f"refs={refs}" in msg and event.value in msg and "b1" in msg
    assert "unreferenced" in msg
    # At zero references the same event is fine.
    assert next_state("b1", S.COMMITTED, event, 0) in (S.EVICTED, S.RECLAIMED)


def test_unpin_at_zero_refs_is_rejected():
    with pytest.raises(InvalidTransition) as info:
        next_state("b2", S.COMMITTED, E.UNPIN, 0)
    assert "refs=0" in str(info.value) and "negative" in str(info.value)
    with pytest.raises(InvalidTransition):
        next_state("b2", S.COMMITTED, E.UNPIN, -1)
    assert next_state("b2", S.COMMITTED, E.UNPIN, 1) is S.COMMITTED


@pytest.mark.parametrize("refs", [0, 1, 5])
def test_pin_is_allowed_at_any_reference_count(refs):
    assert next_state("b3", S.COMMITTED, E.PIN, refs) is S.COMMITTED


def test_invalid_pair_wins_over_reference_checks():
    # A pending block cannot be evicted whatever its refs: the table is consulted first.
    with pytest.raises(InvalidTransition) as info:
        next_state("b4", S.PENDING, E.EVICT, 3)
    assert info.value.state == S.PENDING.value


# ---------------------------------------------------------------- disk entries

DISK_EXPECTED = {
    (DS.ABSENT, DE.RESERVE): DS.WRITING,
    (DS.WRITING, DE.WRITTEN): DS.STORED,
    (DS.WRITING, DE.FAILED): DS.ABSENT,
    (DS.ABSENT, DE.ADOPT): DS.STORED,
    (DS.STORED, DE.PIN): DS.STORED,
    (DS.STORED, DE.UNPIN): DS.STORED,
    (DS.ABSENT, DE.UNPIN): DS.ABSENT,
    (DS.STORED, DE.EVICT): DS.ABSENT,
    (DS.STORED, DE.DROP): DS.ABSENT,
}
DISK_INVALID = [pair for pair in itertools.product(DS, DE) if pair not in DISK_EXPECTED]


def test_disk_table_is_exactly_the_documented_lifecycle():
    assert DISK_TRANSITIONS == DISK_EXPECTED
    assert DISK_REQUIRES_UNPINNED == {DE.EVICT}
    assert len(DISK_INVALID) + len(DISK_EXPECTED) == len(DS) * len(DE) == 24


def test_disk_states_read_as_the_strings_admin_reports():
    assert [s.value for s in DS] == ["absent", "writing", "stored"]
    assert DS.STORED == "stored" and DS.WRITING == "writing"


@pytest.mark.parametrize(("state", "event"), sorted(DISK_EXPECTED, key=str))
def test_valid_disk_transitions_return_the_next_state(state, event):
    pins = 1 if event is DE.UNPIN else 0
    assert next_disk_state("e", state, event, pins) is DISK_EXPECTED[(state, event)]


@pytest.mark.parametrize(("state", "event"), DISK_INVALID, ids=lambda v: v.name)
def test_invalid_disk_pair_raises_naming_entry_state_and_event(state, event):
    with pytest.raises(InvalidTransition) as info:
        next_disk_state("ns01/abcdef", state, event, 1 if event is DE.UNPIN else 0)
    err = info.value
    assert (err.block, err.state, err.event) == ("ns01/abcdef", state.value, event.value)
    assert repr(state.value) in str(err) and repr(event.value) in str(err)


@pytest.mark.parametrize("pins", [1, 3])
def test_evicting_a_pinned_disk_entry_is_rejected(pins):
    with pytest.raises(InvalidTransition) as info:
        next_disk_state("e1", DS.STORED, DE.EVICT, pins)
    assert f"pins={pins}" in str(info.value) and "unpinned" in str(info.value)
    # Drop is not bound by pins: the file is gone whoever reads it.
    assert next_disk_state("e1", DS.STORED, DE.DROP, pins) is DS.ABSENT


@pytest.mark.parametrize("state", [DS.STORED, DS.ABSENT])
def test_disk_unpin_at_zero_pins_is_rejected(state):
    with pytest.raises(InvalidTransition) as info:
        next_disk_state("e2", state, DE.UNPIN, 0)
    assert "pins=0" in str(info.value) and "negative" in str(info.value)
