"""Eviction policies (server/ledger/policy.py): LRU and hits-then-LRU."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkeeper.server.ledger.policy import (POLICIES, EvictionPolicy, HitsLRUPolicy, LRUPolicy,
                                           make_policy)


class Blk:
    __slots__ = ("name", "hits", "prev", "next")

    def __init__(self, name: str, hits: int = 0) -> None:
        self.name, self.hits = name, hits
        self.prev = self.next = None

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
    assert make_policy("lru") is not make_policy("lru")
    assert set(POLICIES) == {"lru", "hits-lru"}


@pytest.mark.parametrize("name", ["LRU", "fifo", "", "hits_lru"])
def test_make_policy_unknown_name_lists_the_choices(name):
    with pytest.raises(ValueError) as info:
        make_policy(name)
    msg = str(info.value)
    assert repr(name) in msg and "'hits-lru'" in msg and "'lru'" in msg


# ------------------------------------------------------------------ LRU
def test_lru_evicts_in_the_order_blocks_became_evictable():
    p = LRUPolicy()
    blocks = [Blk(n, hits=h) for n, h in zip("abcd", (9, 0, 5, 1))]
    for b in blocks:
        p.add(b)
    assert [b.name for b in p] == list("abcd")  # hits are ignored
    assert len(p) == 4
    assert drain(p) == list("abcd")
    assert len(p) == 0 and p.pop() is None


def test_lru_readd_moves_a_block_to_the_back():
    p = LRUPolicy()
    a, b, c = Blk("a"), Blk("b"), Blk("c")
    for x in (a, b, c):
        p.add(x)
    p.remove(a)
    p.add(a)  # a was used again
    assert [x.name for x in p] == ["b", "c", "a"]
    p.remove(c)
    assert len(p) == 2 and drain(p) == ["b", "a"]


def test_lru_remove_of_a_block_not_held_raises():
    p = LRUPolicy()
    with pytest.raises(ValueError):
        p.remove(Blk("x"))
    assert len(p) == 0


# ------------------------------------------------------------------ hits-lru
def test_hits_lru_fewest_hits_first_then_least_recently_freed():
    p = HitsLRUPolicy()
    order = [("a", 2), ("b", 0), ("c", 1), ("d", 0), ("e", 2), ("f", 1)]
    for n, h in order:
        p.add(Blk(n, h))
    expected = ["b", "d", "c", "f", "a", "e"]
    assert [b.name for b in p] == expected
    assert len(p) == 6
    assert drain(p) == expected
    assert len(p) == 0 and p.pop() is None


def test_hits_lru_matches_the_seed_sort_key():
    # The seed sorts candidates by (hits, last_used, -size); last_used is the add order here.
    p = HitsLRUPolicy()
    spec = [(3, 1), (1, 2), (3, 3), (0, 4), (1, 5), (0, 6)]  # (hits, last_used)
    blocks = [Blk(f"b{t}", h) for h, t in spec]
    for b in blocks:
        p.add(b)
    seed_order = [f"b{t}" for h, t in sorted(spec)]
    assert drain(p) == seed_order


def test_hits_lru_a_hit_moves_a_block_to_a_later_bucket():
    p = HitsLRUPolicy()
    a, b = Blk("a"), Blk("b")
    p.add(a)
    p.add(b)
    p.remove(a)       # what the ledger does on a hit: unlink, count, relink
    a.hits += 1
    p.add(a)
    assert [x.name for x in p] == ["b", "a"]
    p.remove(b)
    b.hits += 2
    p.add(b)
    assert [x.name for x in p] == ["a", "b"]


def test_hits_lru_empty_buckets_are_skipped_and_dropped_by_pop():
    p = HitsLRUPolicy()
    low = [Blk("l0", 0), Blk("l1", 0)]
    mid = Blk("m", 1)
    high = Blk("h", 4)
    for b in (*low, mid, high):
        p.add(b)
    for b in low:
        p.remove(b)   # bucket 0 is now empty
    assert len(p) == 2 and [b.name for b in p] == ["m", "h"]
    assert p.pop() is mid
    # pop walked past bucket 0 and threw it away, with its heap entry.
    assert 0 not in p._buckets and 0 not in p._heap
    assert p.pop() is high and p.pop() is None
    assert p._heap == [] and p._buckets == {} and len(p) == 0
    # A bucket that was dropped comes back when a block needs it.
    again = Blk("again", 0)
    p.add(again)
    assert len(p) == 1 and p.pop() is again


def test_hits_lru_bookkeeping_stays_bounded_for_a_hot_block():
    """A block hit many times while evictable must not leave a bucket per hit count.

    Without a bound, a hot prefix hit a million times between evictions would keep
    a million empty free lists and heap entries alive.
    """
    p = HitsLRUPolicy()
    cold = Blk("cold", 0)
    hot = Blk("hot", 1)
    p.add(cold)
    p.add(hot)
    for i in range(2000):
        if i % 2:
            p.hit(hot)
        else:
            p.remove(hot)
            hot.hits += 1
            p.add(hot)
    assert len(p) == 2 and hot.hits == 2001
    assert len(p._buckets) <= 8 and len(p._heap) <= 32
    assert [b.name for b in p] == ["cold", "hot"]
    assert drain(p) == ["cold", "hot"]


def test_hits_lru_remove_of_a_block_not_held_raises():
    p = HitsLRUPolicy()
    p.add(Blk("a", 0))
    with pytest.raises((ValueError, KeyError)):
        p.remove(Blk("x", 3))
    with pytest.raises(ValueError):
        p.remove(Blk("y", 0))
    assert len(p) == 1


# ------------------------------------------------------------------ both, against a model
OPS = st.lists(st.tuples(st.sampled_from(["add", "remove", "hit", "pop"]),
                         st.integers(0, 7), st.integers(0, 3)), max_size=80)


@pytest.mark.parametrize("name", ["lru", "hits-lru"])
@settings(max_examples=120, deadline=None)
@given(ops=OPS)
def test_policy_matches_a_sorted_reference_model(name, ops):
    """Iteration and pop order equal a sort by the policy's key over a plain dict."""
    p = make_policy(name)
    blocks = [Blk(str(i)) for i in range(8)]
    held: dict[int, int] = {}  # block index -> sequence number when it became evictable
    clock = 0

    def expected() -> list[str]:
        if name == "lru":
            keyf = lambda i: held[i]  # noqa: E731
        else:
            keyf = lambda i: (blocks[i].hits, held[i])  # noqa: E731
        return [blocks[i].name for i in sorted(held, key=keyf)]

    for op, i, h in ops:
        b = blocks[i]
        clock += 1
        if op == "add":
            if i in held:
                continue
            b.hits = h if name == "hits-lru" else b.hits
            p.add(b)
            held[i] = clock
        elif op == "remove":
            if i not in held:
                continue
            p.remove(b)
            del held[i]
        elif op == "hit":
            if i not in held:
                continue
            before = b.hits
            p.hit(b)                      # what the ledger calls on a match
            assert b.hits == before + 1
            held[i] = clock
        else:
            want = expected()
            got = p.pop()
            if not want:
                assert got is None
            else:
                assert got is not None and got.name == want[0]
                del held[int(got.name)]
        assert [x.name for x in p] == expected()
        assert len(p) == len(held)


@pytest.mark.parametrize("name", ["lru", "hits-lru"])
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


@pytest.mark.parametrize("name", ["lru", "hits-lru"])
def test_hit_all_of_a_block_not_held_raises(name):
    p = make_policy(name)
    a = Blk("a")
    p.add(a)
    with pytest.raises((ValueError, KeyError)):
        p.hit_all([a, Blk("x")])
    assert len(p) == 1
    if name == "lru":  # one pass that checks first: nothing changed
        assert a.hits == 0


@pytest.mark.parametrize("name", ["lru", "hits-lru"])
def test_hit_counts_and_moves_a_block_behind_its_equals(name):
    p = make_policy(name)
    a, b, c = Blk("a"), Blk("b"), Blk("c")
    for x in (a, b, c):
        p.add(x)
    p.hit(a)
    assert a.hits == 1 and len(p) == 3
    assert [x.name for x in p] == ["b", "c", "a"]
    p.hit(b)
    # LRU: pure recency. hits-lru: b joins a's bucket behind it; c (0 hits) goes first.
    assert [x.name for x in p] == (["c", "a", "b"])
    assert drain(p) == ["c", "a", "b"]


@pytest.mark.parametrize("name", ["lru", "hits-lru"])
def test_hit_of_a_block_not_held_raises(name):
    p = make_policy(name)
    p.add(Blk("a"))
    with pytest.raises((ValueError, KeyError)):
        p.hit(Blk("x"))
    assert len(p) == 1
