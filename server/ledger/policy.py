"""Pluggable eviction policies over the set of evictable blocks (or disk entries).

A policy only orders blocks that are committed and unreferenced; the ledger
adds a block when its last reference goes and removes it when a lease pins it,
so a pinned block can never be chosen. Policies are named in the config
(POLICIES); every one is O(1) per operation (amortised for the ones that
reinsert), holds its nodes in intrusive lists, and keeps its per-block state
in one small int, `node.pq` (bits below), so a block costs it no allocation.

A page tier wraps its policy in chains.ChainPolicy, which keeps chain order on
top of any of these: a parent is never chosen before its cached children, and
a block whose parent is gone goes first. The disk tier's book uses a policy as
is (its entries have no chain links), with the policy's admission rule.

    lru       least recently used first (vLLM's free block queue)
    hits-lru  segmented LRU: a hit moves a block to a protected segment of at
              most 80% of the blocks; the protected segment's oldest fall
              back to probation, so hits decay (the seed's hit counts never did)
    s3fifo    S3-FIFO (s3fifo.py): a small probationary FIFO, a main FIFO with
              reinsertion by a 2-bit decaying frequency, and a ghost table of
              recently evicted keys: scan-resistant and frequency-aware; its
              admission (admit_run) refuses a long run of keys nobody saved
              lately on a full tier, and evicts it first when admitted; a
              conversation re-reading its own history (reread) earns a
              frequency of 1 at most
"""
from __future__ import annotations

from typing import Callable

from .recency import (ADMIT, COLD, COLD_RUN, FREQ, MAX_FREQ, QUEUE, Q1, Q2, REFUSE, WARM_RUN,
                      EvictionPolicy, HitsLRUPolicy, LRUPolicy)
from .s3fifo import S3FIFOPolicy

POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    HitsLRUPolicy.name: HitsLRUPolicy,
    S3FIFOPolicy.name: S3FIFOPolicy,
}
# What `[ledger] eviction_policy` is when unset: the best across the policy
# benchmark's traffic mixes (README, "Eviction policies").
DEFAULT_POLICY = S3FIFOPolicy.name


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None


__all__ = ["ADMIT", "COLD", "COLD_RUN", "DEFAULT_POLICY", "FREQ", "MAX_FREQ", "POLICIES", "Q1", "Q2",
           "QUEUE", "REFUSE", "WARM_RUN", "EvictionPolicy", "HitsLRUPolicy", "LRUPolicy", "S3FIFOPolicy",
           "make_policy"]
