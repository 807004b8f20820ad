"""S3-FIFO (server/ledger/s3fifo.py): probation, main, ghosts, the adapting share."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from policy_helpers import Blk, drain
from kvkeeper.server.ledger.policy import LRUPolicy
from kvkeeper.server.ledger.s3fifo import Ghost, S3FIFOPolicy


def test_s3fifo_a_key_evicted_from_probation_returns_to_main():
    p = S3FIFOPolicy()
    first = Blk("k")
    p.add(first)
    assert p.pop() is first    # evicted unhit from probation: its key is a ghost now
    again = Blk("k")           # saved again under the same key
    others = [Blk(str(i)) for i in range(20)]
    for b in others:
        p.add(b)
    p.add(again)
    order = [b.name for b in p]
    assert order[-1] == "k" and drain(p) == order   # main: after all of probation


def test_s3fifo_admission_turns_a_cold_key_away_once():
    p = S3FIFOPolicy()
    assert not p.admits(None, b"cold", 0)    # first sight: remembered, not admitted
    assert p.admits(None, b"cold", 0)        # it came again
    assert p.admits(None, b"hot", 2)         # hit above: admitted at once
    assert LRUPolicy().admits(None, b"cold", 0)


def test_ghost_remembers_forgets_and_grows():
    g = Ghost(16)
    g.put(b"a")
    assert b"a" in g and g.take(b"a") and not g.take(b"a")
    g.put(b"b")
    g.fit(64)                  # grown: forgotten, and larger
    assert b"b" not in g and len(g._table) >= 64


def test_s3fifo_probation_grows_on_its_ghosts_and_shrinks_on_main_s():
    p = S3FIFOPolicy()
    start = p.share
    for i in range(30):                 # evicted unhit from probation, then back
        b = Blk(f"k{i}")
        p.add(b)
        assert p.pop() is b
        p.add(Blk(f"k{i}"))
        drain(p)
    grown = p.share
    assert grown > start
    p.main_ghost.put(b"m")
    m = Blk("m")
    p.add(m)                             # came back from main's ghost: to main, share down
    assert p.share < grown and m.pq & 0xC == 0x8


@settings(max_examples=60, deadline=None)
@given(n=st.integers(20, 200), hit_every=st.integers(2, 7))
def test_s3fifo_long_drains_follow_the_listed_order(n, hit_every):
    """The share moves with every eviction: iteration simulates that too."""
    p = S3FIFOPolicy()
    blocks = [Blk(str(i)) for i in range(n)]
    for i, b in enumerate(blocks):
        p.add(b)
        if i % hit_every == 0:
            p.hit(b)
    listed = [b.name for b in p]
    assert drain(p) == listed
