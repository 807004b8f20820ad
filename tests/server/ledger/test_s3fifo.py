"""S3-FIFO (server/ledger/s3fifo.py): probation, main, ghosts, the adapting share,
cold runs and their admission."""
from __future__ import annotations

from hypothesis import given, settings
from hypothesis import strategies as st

from policy_helpers import Blk, drain
from kvkeeper.server.ledger.chains import GONE
from kvkeeper.server.ledger.policy import (ADMIT, COLD, COLD_RUN, FREQ, QUEUE, Q1, Q2, REFUSE,
                                           WARM_RUN, HitsLRUPolicy, LRUPolicy)
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
    p.main_ghost.put((b"ns", b"m"))
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


# ------------------------------------------------------------------ cold runs
def cold(name):
    b = Blk(name)
    b.pq |= COLD          # as the ledger files a block of a run admit_run called cold
    return b


def test_s3fifo_cold_blocks_go_first_and_a_hit_sends_one_to_main():
    p = S3FIFOPolicy()
    warm = [Blk(f"w{i}") for i in range(5)]
    docs = [cold(f"c{i}") for i in range(4)]
    for b in warm + docs:
        p.add(b)
    assert [b.name for b in p][:4] == ["c0", "c1", "c2", "c3"] and len(p) == 9
    p.hit(docs[1])
    assert not docs[1].pq & COLD and docs[1].pq & 0xC == 0x8
    p.remove(docs[2])                      # pinned: comes back cold
    p.add(docs[2])
    listed = [b.name for b in p]
    assert listed[:3] == ["c0", "c3", "c2"] and listed[-1] == "c1"
    assert drain(p) == listed
    assert (b"ns", b"c0") in p.ghost                # evicted unhit, as from probation


def test_s3fifo_admit_run_refuses_a_long_fresh_run_only_when_it_would_evict():
    p = S3FIFOPolicy()
    doc = [b"d%d" % i for i in range(S3FIFOPolicy.RUN + 1)]
    assert p.admit_run(doc[:-1], None, evicts=True) == ADMIT       # RUN keys: short
    assert p.admit_run(doc, None, evicts=False) == COLD_RUN
    assert p.admit_run(doc, None, evicts=True) == REFUSE
    assert p.admit_run(doc, None, evicts=True) == ADMIT            # remembered: its ghosts
    assert p.admit_run([b"x"], GONE, evicts=True) == ADMIT         # filed stranded instead
    assert p.admit_run([b"y"], cold("p"), evicts=False) == COLD_RUN
    assert p.admit_run([b"z"], Blk("p"), evicts=True) == ADMIT     # never hit: not warm
    for other in (LRUPolicy(), HitsLRUPolicy()):
        assert other.admit_run(doc + [b"n"], GONE, evicts=True) == ADMIT


def test_s3fifo_a_run_under_a_leaf_read_once_is_warm_and_probation_keeps_it():
    """A conversation's next turn hangs under the leaf it just read back
    (hits 1, no cached child): WARM. A shared prefix (it has a child) or a
    document read again (hits 2) is not; nor is a long fresh run (cold)."""
    p = S3FIFOPolicy()
    leaf = Blk("turn", hits=1)
    assert p.admit_run([b"m0", b"m1"], leaf, evicts=True) == WARM_RUN
    shared = Blk("system", hits=1)
    shared.child = Blk("other message")
    assert p.admit_run([b"m2"], shared, evicts=True) == ADMIT
    assert p.admit_run([b"m3"], Blk("doc", hits=2), evicts=True) == ADMIT
    long_run = [b"l%d" % i for i in range(S3FIFOPolicy.RUN + 1)]
    assert p.admit_run(long_run, leaf, evicts=True) == REFUSE
    for other in (LRUPolicy(), HitsLRUPolicy()):
        assert other.admit_run([b"m4"], leaf, evicts=True) == ADMIT
    # Filed warm (the ledger sets a frequency of 1): probation hands it to
    # main where an unhit block of the same age is let go.
    warm, plain = Blk("warm"), Blk("plain")
    warm.pq |= 1
    mains = [Blk(f"main{i}") for i in range(10)]
    for b in mains:
        b.pq = Q2        # already in main (as after a ghost hit)
    q = S3FIFOPolicy()
    for b in [plain, warm] + mains:
        q.add(b)
    assert warm.pq & QUEUE == Q1 and warm.pq & FREQ == 1 and plain.pq & FREQ == 0
    assert q.pop() is plain
    assert warm.pq & QUEUE == Q1
    while (b := q.pop()) is not warm:
        assert b in mains
    assert (b"ns", b"plain") in q.ghost and (b"ns", b"warm") not in q.ghost


def test_s3fifo_a_reread_earns_at_most_one_pass_through_main():
    """A conversation's history re-read by each next turn (reread) is one
    client's correlated reference: however often, it buys one reinsertion in
    main, where two hits by others buy two."""
    p = S3FIFOPolicy()
    p.share = p.MIN_SHARE
    own, shared = Blk("own"), Blk("shared")
    for b in (own, shared):
        b.pq |= Q2        # in main, where a block hit on probation ends up
        p.add(b)
    for _ in range(3):
        p.reread(own)
    p.hit(shared)
    p.hit(shared)
    assert own.hits == 3 and own.pq & FREQ == 1
    assert shared.hits == 2 and shared.pq & FREQ == 2
    others = [Blk(f"o{i}") for i in range(3)]
    for b in others:
        b.pq |= Q2
        p.add(b)
    # Main's order: own, shared, o0..o2. own is reinserted once, shared twice.
    assert drain(p) == ["o0", "o1", "o2", "own", "shared"]


def test_s3fifo_a_reread_cold_block_is_no_one_off():
    p = S3FIFOPolicy()
    b = cold("c")
    p.add(b)
    p.reread(b)
    assert not b.pq & COLD and b.pq & QUEUE == Q2 and b.hits == 1
