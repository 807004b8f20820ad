"""The block lifecycle transition table (server/ledger/states.py)."""
from __future__ import annotations

import itertools

import pytest

from kvkeeper.server.errors import ClientError, FailedPrecondition, InvalidTransition
from kvkeeper.server.ledger.states import (REQUIRES_UNREFERENCED, TRANSITIONS, BlockState,
                                           Event, next_state)

S, E = BlockState, Event

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
