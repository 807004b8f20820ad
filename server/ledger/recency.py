"""The eviction policies' common contract and the two recency orders, lru and
hits-lru (see policy.py for the registry and what each policy does)."""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Any, Iterator, Sequence

from .freelist import FreeList

# node.pq bits: 0-1 a 2-bit frequency, 2-3 the policy's own queue (0: never
# placed), 4-5 where ChainPolicy holds it, 6 stranded (chains.py), 7 a block
# of a cold run not hit since (the ledger sets it when admit_run says
# COLD_RUN). All fit in 8 bits: CPython shares the ints up to 256, so the
# field costs no object per block.
FREQ = 0x3
QUEUE = 0xC
Q1, Q2 = 0x4, 0x8
MAX_FREQ = 3
COLD = 0x80

# What a page tier's policy answers about a reserve's new keys (admit_run).
ADMIT, COLD_RUN, REFUSE, WARM_RUN = "admit", "cold", "refuse", "warm"


class EvictionPolicy(ABC):
    name: str = ""

    @abstractmethod
    def add(self, block: Any) -> None:
        """`block` became evictable."""

    @abstractmethod
    def remove(self, block: Any) -> None:
        """`block` is no longer evictable (pinned, or dropped by the ledger)."""

    @abstractmethod
    def hit(self, block: Any) -> None:
        """`block`, evictable, was hit: count it (block.hits += 1) and reorder."""

    def reread(self, block: Any) -> None:
        """`block`, evictable, was read back by its own chain's continuation:
        a lookup that ran down to a leaf through blocks nobody else branched
        from (a conversation's next turn reading its history). That is one
        client re-reading what it wrote, a correlated reference as LRU-K
        calls it, not a sign that the block is popular: count it
        (block.hits += 1) and refresh its recency, but a frequency-aware
        policy gives it no frequency. Recency policies: hit()."""
        self.hit(block)

    def hit_all(self, blocks: Sequence[Any], rereads: int = 0) -> None:
        """reread() the first `rereads` of `blocks`, then hit() the rest, in
        order (a lookup's run of evictable hits, tail first); a policy may do
        it in one pass."""
        for i, b in enumerate(blocks):
            if i < rereads:
                self.reread(b)
            else:
                self.hit(b)

    @abstractmethod
    def pop(self) -> Any:
        """Unlink and return the next victim, or None."""

    @abstractmethod
    def demote(self, block: Any) -> None:
        """`block`, evictable, will not be read again soon (its client said a
        conversation's last turn read it): evict it before the blocks nobody
        said that of, unless it is hit again first. A hit undoes it, so a
        shared prefix that another request reads keeps its place."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Any]:
        """Blocks in the order pop() would return them if nothing else changed
        (O(n): for tests and admin, never on a request path)."""

    def admits(self, node: Any, key: Any, hits: int) -> bool:
        """Admission to a full cache (the disk tier's book asks before it
        evicts for a new copy): may `key` displace what is held? `hits`: how
        often its block was hit above. Recency policies admit everything."""
        return True

    def admit_run(self, keys: Sequence[Any], parent: Any, evicts: bool) -> str:
        """Admission to a page tier: a reserve is about to file `keys`, the new
        keys of one run of a chain, the first under `parent` (a block, None,
        or chains.GONE). `evicts`: making their room evicts. ADMIT; COLD_RUN:
        file them, each marked COLD (evicted before anything else until hit);
        WARM_RUN: file them with a frequency of 1, as if hit once (a run that
        continues a chain being read again); REFUSE: file none of them, evict
        nothing. Recency policies admit all."""
        return ADMIT


class LRUPolicy(EvictionPolicy):
    """Least recently used first: one free list, O(1) for every operation."""

    name = "lru"

    def __init__(self) -> None:
        self._list = FreeList()

    def add(self, block: Any) -> None:
        self._list.append(block)

    def remove(self, block: Any) -> None:
        self._list.remove(block)

    def hit(self, block: Any) -> None:
        block.hits += 1
        self._list.move_to_back(block)

    def hit_all(self, blocks: Sequence[Any], rereads: int = 0) -> None:
        # A reread is a hit here: recency is all lru counts.
        self._list.move_all_to_back(blocks)  # first: it raises before changing anything
        for b in blocks:
            b.hits += 1

    def pop(self) -> Any:
        return self._list.popleft()

    def demote(self, block: Any) -> None:
        self._list.move_to_front(block)

    def __len__(self) -> int:
        return len(self._list)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._list)


class HitsLRUPolicy(EvictionPolicy):
    """Segmented LRU: probation first, then protected, each least recently used first.

    A block enters probation. A hit moves it to the back of protected; while
    protected holds more than PROTECTED of the blocks its front falls back to
    the back of probation. So a block's hits count only while it keeps being
    hit: the seed's order (fewest hits ever, then LRU) let blocks with a few
    early hits crowd out new conversations for good. O(1) per operation.
    """

    name = "hits-lru"
    PROTECTED = 0.8

    def __init__(self) -> None:
        self._probation = FreeList()
        self._protected = FreeList()

    def _list(self, block: Any) -> FreeList:
        return self._protected if block.pq & QUEUE == Q2 else self._probation

    def add(self, block: Any) -> None:
        if not block.pq & QUEUE:
            block.pq |= Q1
        self._list(block).append(block)
        self._balance()

    def remove(self, block: Any) -> None:
        self._list(block).remove(block)

    def hit(self, block: Any) -> None:
        block.hits += 1
        if block.pq & QUEUE == Q2:
            self._protected.move_to_back(block)
            return
        self._probation.remove(block)
        block.pq = (block.pq & ~QUEUE) | Q2
        self._protected.append(block)
        self._balance()

    def _balance(self) -> None:
        prot = self._protected
        while len(prot) > self.PROTECTED * (len(prot) + len(self._probation)) and len(prot) > 1:
            b = prot.popleft()
            b.pq = (b.pq & ~QUEUE) | Q1
            self._probation.append(b)

    def pop(self) -> Any:
        b = self._probation.popleft()
        return self._protected.popleft() if b is None else b

    def demote(self, block: Any) -> None:
        if block.pq & QUEUE == Q2:
            self._protected.remove(block)
            block.pq = (block.pq & ~QUEUE) | Q1
            self._probation.append(block)
        self._probation.move_to_front(block)

    def __len__(self) -> int:
        return len(self._probation) + len(self._protected)

    def __iter__(self) -> Iterator[Any]:
        yield from list(self._probation)
        yield from list(self._protected)
