"""The eviction policies' registry (server/ledger/policy.py) and the one
contract every named policy passes (what each is for: test_recency.py,
test_s3fifo.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from policy_helpers import Blk, drain
from kvkeeper.server.ledger.policy import (COLD, DEFAULT_POLICY, POLICIES, QUEUE, HitsLRUPolicy,
                                           LRUPolicy, S3FIFOPolicy, make_policy)

NAMES = sorted(POLICIES)


# ------------------------------------------------------------------ registry
def test_make_policy_builds_fresh_instances_by_name():
    assert isinstance(make_policy("lru"), LRUPolicy)
    assert isinstance(make_policy("hits-lru"), HitsLRUPolicy)
    assert isinstance(make_policy("s3fifo"), S3FIFOPolicy)
    assert make_policy("lru") is not make_policy("lru")
    assert set(POLICIES) == {"lru", "hits-lru", "s3fifo"} and DEFAULT_POLICY in POLICIES
    for name in NAMES:
        assert make_policy(name).name == name


@pytest.mark.parametrize("name", ["LRU", "fifo", "", "hits_lru", "s3-fifo"])
def test_make_policy_unknown_name_lists_the_choices(name):
    with pytest.raises(ValueError) as info:
        make_policy(name)
    msg = str(info.value)
    assert repr(name) in msg and all(repr(n) in msg for n in NAMES)


# ------------------------------------------------------------------ the contract
# add-cold: a block of a run admit_run called cold, as the ledger files it.
OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "add-cold", "remove", "hit", "hit", "pop",
                                          "demote"]),
                         st.integers(0, 11)), max_size=120)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=150, deadline=None)
@given(ops=OPS)
def test_iteration_is_the_pop_order_and_holds_exactly_the_evictable(name, ops):
    """Whatever the history: iteration lists exactly the held blocks, its first is
    what pop() returns, and draining pops them in the listed order."""
    p = make_policy(name)
    blocks = [Blk(str(i)) for i in range(12)]
    held: set[int] = set()
    for op, i in ops:
        b = blocks[i]
        if op.startswith("add") and i not in held:
            if op == "add-cold" and not b.pq & QUEUE:   # only a new block is filed cold
                b.pq |= COLD
            p.add(b)
            held.add(i)
        elif op == "remove" and i in held:
            p.remove(b)
            held.discard(i)
        elif op == "hit" and i in held:
            before = b.hits
            p.hit(b)
            assert b.hits == before + 1
        elif op == "demote" and i in held:
            p.demote(b)
        elif op == "pop":
            listed = list(p)
            got = p.pop()
            if not held:
                assert got is None and listed == []
            else:
                assert got is listed[0]
                held.discard(int(got.name))
        listed = [x.name for x in p]
        assert sorted(listed) == sorted(str(i) for i in held) and len(p) == len(held)
    listed = [x.name for x in p]
    assert drain(p) == listed and len(p) == 0 and p.pop() is None


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=80, deadline=None)
@given(runs=st.lists(st.tuples(st.lists(st.integers(0, 5), max_size=8), st.integers(0, 8)),
                     max_size=5), demoted=st.sets(st.integers(0, 5)))
def test_hit_all_equals_one_hit_or_reread_per_block(name, runs, demoted):
    """A lookup's run of hits in one call, hit_all(run, rereads=k): the same
    counts and order as reread() of the first k and hit() of the rest, each
    counted once in block.hits (k = 0: all hits), demoted blocks (s3fifo's
    cold queue) among them."""
    one, batch = make_policy(name), make_policy(name)
    a = [Blk(str(i)) for i in range(6)]
    b = [Blk(str(i)) for i in range(6)]
    for x, y in zip(a, b):
        one.add(x)
        batch.add(y)
    for i in sorted(demoted):
        one.demote(a[i])
        batch.demote(b[i])
    for run, k in runs:
        before = sum(x.hits for x in a)
        for j, i in enumerate(run):
            (one.reread if j < k else one.hit)(a[i])
        assert sum(x.hits for x in a) == before + len(run)
        batch.hit_all([b[i] for i in run], rereads=k)
        assert [(x.name, x.hits) for x in batch] == [(x.name, x.hits) for x in one]
    assert drain(batch) == drain(one)


@pytest.mark.parametrize("name", NAMES)
@settings(max_examples=80, deadline=None)
@given(hits=st.lists(st.integers(0, 7), max_size=12), demoted=st.integers(0, 7))
def test_a_demoted_block_goes_before_every_block_not_demoted(name, hits, demoted):
    """Whatever was hit before: demote(b) puts b ahead of every block that was
    neither demoted nor filed cold."""
    p = make_policy(name)
    blocks = [Blk(str(i)) for i in range(8)]
    for b in blocks:
        p.add(b)
    for i in hits:
        p.hit(blocks[i])
    p.demote(blocks[demoted])
    assert list(p)[0] is blocks[demoted] and p.pop() is blocks[demoted]
    assert sorted(drain(p) + [str(demoted)], key=int) == [str(i) for i in range(8)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("demoted", [0, 3, 7])
def test_a_hit_undoes_a_demotion(name, demoted):
    """A demoted block read again (a shared prefix another request reads) is no
    longer first: blocks never hit go before it."""
    p = make_policy(name)
    blocks = [Blk(str(i)) for i in range(8)]
    for b in blocks:
        p.add(b)
    p.demote(blocks[demoted])
    p.hit(blocks[demoted])
    order = drain(p)
    assert order[0] != str(demoted) and sorted(order, key=int) == [str(i) for i in range(8)]


@pytest.mark.parametrize("name", NAMES)
@pytest.mark.parametrize("move", ["remove", "demote"])
def test_a_move_of_a_block_not_held_raises(name, move):
    p = make_policy(name)
    p.add(Blk("a"))
    with pytest.raises(ValueError):
        getattr(p, move)(Blk("x"))
    assert len(p) == 1 and drain(p) == ["a"]


@pytest.mark.parametrize("name", NAMES)
def test_a_removed_block_comes_back_where_its_policy_puts_it(name):
    """Pinned and released again (remove, add): held once, in the order, popped once."""
    p = make_policy(name)
    blocks = [Blk(n) for n in "abcd"]
    for b in blocks:
        p.add(b)
    p.hit(blocks[0])
    p.remove(blocks[0])
    p.add(blocks[0])
    assert sorted(drain(p)) == list("abcd")


# ------------------------------------------------------------------ frequency-aware ones
@pytest.mark.parametrize("name", ["hits-lru", "s3fifo"])
def test_a_scan_does_not_flush_blocks_that_are_hit(name):
    """One-off blocks (a long document read once) pass through probation; the
    blocks that were hit outlive them all."""
    p = make_policy(name)
    for i in range(4):
        p.add(Blk(f"c{i}"))
    hot = [Blk(f"h{i}") for i in range(4)]
    for b in hot:
        p.add(b)
        p.hit(b)
    victims = []
    for i in range(100):      # the scan: each new block evicts one
        p.add(Blk(f"s{i}"))
        victims.append(p.pop().name)
    assert not any(v.startswith("h") for v in victims)
    lru = LRUPolicy()          # the same under lru flushes them
    for i in range(4):
        lru.add(Blk(f"c{i}"))
    for b in [Blk(f"h{i}") for i in range(4)]:
        lru.add(b)
        lru.hit(b)
    lru_victims = []
    for i in range(100):
        lru.add(Blk(f"s{i}"))
        lru_victims.append(lru.pop().name)
    assert sum(v.startswith("h") for v in lru_victims) == 4


@pytest.mark.parametrize("name", ["hits-lru", "s3fifo"])
def test_hits_decay_old_hits_do_not_hold_a_block_for_good(name):
    """A block hit a few times long ago is evicted once newer blocks keep being
    hit (the seed's hits-lru kept it before every block with fewer hits, forever)."""
    p = make_policy(name)
    old = Blk("old")
    p.add(old)
    for _ in range(3):
        p.hit(old)
    gone = False
    for i in range(60):        # new conversations: each block is hit once, twice
        b = Blk(f"n{i}")
        p.add(b)
        p.hit(b)
        p.hit(b)
        if len(p) > 8:
            if p.pop() is old:
                gone = True
                break
    assert gone
