"""MIN blind to ends (server/bench/policy_blind.py): think times read from the
trace, phantom turns of ended conversations, and never above the optimum."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from kvkeeper.server.bench.policy_blind import blind_hits, blind_uses, think_times
from kvkeeper.server.bench.policy_optimum import next_uses, optimum_hits
from kvkeeper.server.bench.policy_trace import Request, extend


def req(name, n, prompt=None, last=False, prefix=()):
    keys = extend(list(prefix), (b"%s.%d" % (name, j) for j in range(n)))
    return Request(tuple(keys), len(keys) if prompt is None else prompt, last_turn=last)


def ended_and_live():
    """A ended after r0; B's next turn (r3) extends its r1 chain."""
    a = req(b"a", 2, last=True)
    b = req(b"b", 2)
    return [a, b, req(b"x", 1), req(b"b2", 1, prefix=b.keys)]


def test_think_times_are_the_gaps_to_the_first_turn_that_extends_a_chain_whole():
    b = req(b"b", 2)
    b2 = req(b"c", 1, prefix=b.keys)
    reqs = [b, req(b"x", 1), req(b"y", 1), b2, req(b"z", 1), req(b"d", 1, prefix=b2.keys),
            req(b"e", 1, prefix=b.keys)]        # a second branch off b: not counted
    assert think_times(reqs) == [3, 2]
    # A prefix of a chain read again is no next turn: only the whole chain.
    assert think_times([b, req(b"f", 1, prefix=b.keys[:1])]) == []


def test_an_ended_conversation_held_for_its_phantom_turn_costs_a_live_ones_hits():
    reqs = ended_and_live()
    assert optimum_hits(reqs, 2) == (2, 8)
    # Believed read again one request later, A's blocks hold the room B needed;
    # they leave when A's turn does not come, too late for B.
    assert blind_hits(reqs, 2, gaps=[1]) == (0, 8)
    uses = blind_uses(reqs, gaps=[1])
    assert uses[0] == [2, 3] and uses[1] == next_uses(reqs)[1]


def test_a_phantom_turn_that_did_not_come_frees_its_room():
    c = req(b"c", 2)
    reqs = [*ended_and_live(), c, req(b"y", 1), req(b"c2", 1, prefix=c.keys)]
    # A's blocks leave after their phantom turn (r1): B's hits are lost, but C is
    # kept for its next turn (held, A's would have kept C out too).
    assert blind_hits(reqs, 2, gaps=[1]) == (2, 14)
    assert optimum_hits(reqs, 2) == (4, 14)


def test_no_ends_or_no_think_times_or_a_turn_due_after_the_trace_is_the_optimum():
    reqs = ended_and_live()
    assert blind_uses(reqs, gaps=[]) == next_uses(reqs)
    assert blind_uses(reqs, gaps=[10]) == next_uses(reqs)
    unmarked = [Request(r.keys, r.prompt_blocks) for r in reqs]
    assert blind_hits(unmarked, 2, gaps=[1]) == optimum_hits(unmarked, 2)
    # The trace's own think times: B's, 2 requests; A's phantom turn is r2 (events 4, 5).
    assert blind_uses(reqs)[0] == [4, 5]


@settings(max_examples=60, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(0, 3), st.integers(1, 3), st.integers(0, 1),
                                 st.booleans()), min_size=1, max_size=8),
       cap=st.integers(0, 4), gaps=st.lists(st.integers(1, 4), min_size=1, max_size=3),
       seed=st.integers(0, 3))
def test_never_above_the_optimum(shapes, cap, gaps, seed):
    reqs = []
    for cid, plen, dlen, last in shapes:
        keys = extend([], (b"c%d.%d" % (cid, j) for j in range(plen + dlen)))
        reqs.append(Request(tuple(keys), plen, last_turn=last))
    hits, asked = blind_hits(reqs, cap, seed=seed, gaps=gaps)
    best, asked_too = optimum_hits(reqs, cap)
    assert asked == asked_too and 0 <= hits <= best
