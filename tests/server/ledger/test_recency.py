"""The recency policies (server/ledger/recency.py): lru, and hits-lru whose hits decay."""
from __future__ import annotations

from policy_helpers import Blk, drain
from kvkeeper.server.ledger.policy import HitsLRUPolicy, LRUPolicy


def test_lru_evicts_in_the_order_blocks_became_evictable_hits_refresh():
    p = LRUPolicy()
    blocks = [Blk(n) for n in "abcd"]
    for b in blocks:
        p.add(b)
    p.hit(blocks[1])
    assert [b.name for b in p] == list("acdb")
    assert drain(p) == list("acdb")


def test_hits_lru_keeps_its_protected_segment_bounded():
    p = HitsLRUPolicy()
    blocks = [Blk(str(i)) for i in range(10)]
    for b in blocks:
        p.add(b)
        p.hit(b)               # every block hit: protected can hold only 80%
    order = [b.name for b in p]
    assert order[:2] == ["0", "1"]       # the oldest hits fell back to probation
    assert drain(p) == order
