"""The offline optimum (server/bench/policy_optimum.py) against brute force on
tiny traces, and its bounds."""
from __future__ import annotations

import functools
import itertools

from hypothesis import given, settings
from hypothesis import strategies as st

from kvkeeper.server.bench.policy_optimum import next_uses, optimum_hits
from kvkeeper.server.bench.policy_trace import Request, extend


def trace_from(shapes):
    """Requests over a few shared chains: (chain id, prompt length, decode length)."""
    reqs = []
    for cid, plen, dlen in shapes:
        keys = extend([], (b"c%d.%d" % (cid, j) for j in range(plen + dlen)))
        reqs.append(Request(tuple(keys), plen))
    return reqs


def brute_force(reqs, cap):
    """Best prefix hits over every choice of what to keep after each request."""

    @functools.lru_cache(maxsize=None)
    def best(i, cache):
        if i == len(reqs):
            return 0
        r = reqs[i]
        h = 0
        for k in r.keys[:r.prompt_blocks]:
            if k not in cache:
                break
            h += 1
        pool = sorted(set(cache) | set(r.keys))
        return h + max(best(i + 1, frozenset(keep))
                       for n in range(min(cap, len(pool)) + 1)
                       for keep in itertools.combinations(pool, n))

    return best(0, frozenset())


@settings(max_examples=40, deadline=None)
@given(shapes=st.lists(st.tuples(st.integers(0, 2), st.integers(1, 3), st.integers(0, 1)),
                       min_size=1, max_size=4), cap=st.integers(1, 2))
def test_it_is_the_optimum_on_tiny_traces(shapes, cap):
    reqs = trace_from(shapes)
    hits, asked = optimum_hits(reqs, cap)
    assert asked == sum(r.prompt_blocks for r in reqs)
    assert hits == brute_force(reqs, cap)


def test_bounds_no_room_no_hits_all_room_every_reread():
    reqs = trace_from([(0, 3, 1), (0, 4, 0), (1, 2, 0), (0, 4, 0)])
    assert optimum_hits(reqs, 0) == (0, 13)
    # Room for all: the 2nd and 4th lookups of chain 0 hit whole (the 1st's decode
    # block is the 2nd's 4th prompt block); nothing else is a re-read.
    assert optimum_hits(reqs, 100) == (8, 13)


def test_next_uses_point_at_the_next_lookup():
    reqs = trace_from([(0, 2, 0), (1, 1, 0), (0, 1, 0)])
    uses = next_uses(reqs)
    assert uses[0][0] == 3 and uses[0][1] == float("inf") and uses[2] == [float("inf")]
