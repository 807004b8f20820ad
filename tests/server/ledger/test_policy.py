"""Eviction policies (server/ledger/policy.py, recency.py, s3fifo.py): one
contract every named policy passes, then what each one is for."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkeeper.server.ledger.policy import (DEFAULT_POLICY, POLICIES, EvictionPolicy,
                                           HitsLRUPolicy, LRUPolicy, S3FIFOPolicy, make_policy)
from kvkeeper.server.ledger.s3fifo import Ghost

NAMES = sorted(POLICIES)


class Blk:
    __slots__ = ("name", "key", "hits", "prev", "next", "pq")

    def __init__(self, name: str, hits: int = 0) -> None:
        self.name, self.hits = name, hits
        self.key = name.encode()
        self.prev = self.next = None
        self.pq = 0

    def __repr__(self) -> str:
        return f"Blk({self.name}, hits={self.hits})"


def drain(p: EvictionPolicy) -> list[str]:
    out = []
    while (b := p.pop()) is not None:
        out.append(b.name)
    return out


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
OPS = st.lists(st.tuples(st.sampled_from(["add", "add", "remove", "hit", "hit", "pop"]),
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
        if op == "add" and i not in held:
            p.add(b)
            held.add(i)
        elif op == "remove" and i in held:
            p.remove(b)
            held.discard(i)
        elif op == "hit" and i in held:
            before = b.hits
            p.hit(b)
            assert b.hits == before + 1
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
@given(hits=st.lists(st.lists(st.integers(0, 5), max_size=8), max_size=5))
def test_hit_all_equals_one_hit_per_block(name, hits):
    """A lookup's run of hits in one call: the same counts and the same order."""
    one, batch = make_policy(name), make_policy(name)
    a = [Blk(str(i)) for i in range(6)]
    b = [Blk(str(i)) for i in range(6)]
    for x, y in zip(a, b):
        one.add(x)
        batch.add(y)
    for run in hits:
        for i in run:
            one.hit(a[i])
        batch.hit_all([b[i] for i in run])
        assert [(x.name, x.hits) for x in batch] == [(x.name, x.hits) for x in one]
    assert drain(batch) == drain(one)


@pytest.mark.parametrize("name", NAMES)
def test_remove_of_a_block_not_held_raises(name):
    p = make_policy(name)
    p.add(Blk("a"))
    with pytest.raises(ValueError):
        p.remove(Blk("x"))
    assert len(p) == 1


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


# ------------------------------------------------------------------ what each is for
def test_lru_evicts_in_the_order_blocks_became_evictable_hits_refresh():
    p = LRUPolicy()
    blocks = [Blk(n) for n in "abcd"]
    for b in blocks:
        p.add(b)
    p.hit(blocks[1])
    assert [b.name for b in p] == list("acdb")
    assert drain(p) == list("acdb")


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


def test_hits_lru_keeps_its_protected_segment_bounded():
    p = HitsLRUPolicy()
    blocks = [Blk(str(i)) for i in range(10)]
    for b in blocks:
        p.add(b)
        p.hit(b)               # every block hit: protected can hold only 80%
    order = [b.name for b in p]
    assert order[:2] == ["0", "1"]       # the oldest hits fell back to probation
    assert drain(p) == order


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
    assert b"b" not in g and len(g._table) >= 128


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
