"""What the trace's future says of a replay (server/bench/policy_liveness.py):
the dead share of the cache, and a replay driven by a client told which
blocks are read again."""
from __future__ import annotations

import pytest

from kvkeeper.server.bench.policy_bench import replay
from kvkeeper.server.bench.policy_liveness import DeadShare, last_lookups, live_prefix
from kvkeeper.server.bench.policy_optimum import optimum_hits
from kvkeeper.server.bench.policy_trace import MIXES, Request, extend, generate


def chain(name: bytes, n: int) -> list[bytes]:
    return extend([], (name + b".%d" % j for j in range(n)))


A = chain(b"a", 5)          # read twice
B = chain(b"b", 8)          # read once: dead as soon as it is saved
TRACE = [Request(tuple(A), 5), Request(tuple(B), 8), Request(tuple(A), 5)]


def test_last_lookups_and_the_live_prefix() -> None:
    last = last_lookups(TRACE)
    assert {last[k] for k in A} == {2} and {last[k] for k in B} == {1}
    assert live_prefix(A, last, 0) == 5      # request 2 reads all of A again
    assert live_prefix(A, last, 2) == 0      # nothing reads it after the last request
    assert live_prefix(B, last, 1) == 0
    # Decode blocks (after the prompt) are never looked up: a chain's live part ends there.
    decoded = Request(tuple(A + chain(b"d", 2)), 5)
    assert live_prefix(decoded.keys, last_lookups([decoded, TRACE[2]]), 0) == 5


def test_dead_share_counts_what_no_later_lookup_reads() -> None:
    d = DeadShare(last_lookups(TRACE))
    d.sample(A + B, 1)                       # after request 1: A is read again, B is not
    assert d.dead == 8 and d.cached == 13
    d.sample(A, 2)                           # after the last request everything is dead
    assert d.share == pytest.approx((8 + 5) / (13 + 5))
    assert DeadShare({}).share == 0.0


@pytest.mark.parametrize("policy", ["lru", "s3fifo"])
def test_a_told_client_keeps_room_for_what_is_read_again(policy: str) -> None:
    # 10 blocks: B's 8 push A out unless the client knows B is never read again.
    untold = replay(TRACE, 10, policy)
    told = replay(TRACE, 10, policy, told=True)
    assert untold.hits < 5 and told.hits == 5
    assert told.dead_share == 0.0 and told.stranded == 0


def test_the_told_replay_sits_between_the_policy_and_the_optimum() -> None:
    reqs = generate(MIXES["chat-heavy"].scaled(400), seed=1)
    hits, asked = optimum_hits(reqs, 200)
    untold, told = replay(reqs, 200, "s3fifo"), replay(reqs, 200, "s3fifo", told=True)
    assert untold.hits < told.hits <= hits
    assert told.dead_share < 0.05 < untold.dead_share


DOC, CONV, ONE_OFF = chain(b"d", 4), chain(b"c", 4), chain(b"e", 4)
HINTED = [Request(tuple(DOC), 4), Request(tuple(CONV), 4),
          Request(tuple(CONV + chain(b"t", 2)), 4, last_turn=True),   # CONV's last turn
          Request(tuple(ONE_OFF), 4), Request(tuple(DOC), 4)]


@pytest.mark.parametrize("policy", ["lru", "hits-lru", "s3fifo"])
def test_a_last_turn_that_says_so_leaves_room_for_what_is_read_again(policy: str) -> None:
    """10 blocks: CONV's last turn would save its tail and keep CONV ahead of
    DOC, so ONE_OFF pushes DOC out; said (hints), it saves nothing and CONV
    goes first."""
    plain = replay(HINTED, 10, policy)
    hinted = replay(HINTED, 10, policy, hints=True)
    assert plain.hits == 4 and hinted.hits == 8       # CONV's last turn, then DOC again
    assert hinted.stranded == 0 and hinted.dropped == 0
