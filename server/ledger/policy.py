"""Pluggable eviction policies over the set of evictable blocks.

A policy only orders blocks that are committed and unreferenced; the ledger
adds a block when its last reference goes and removes it when a lease pins it,
so a pinned block can never be chosen. Policies are named in the config.
"""
from __future__ import annotations

import heapq
from abc import ABC, abstractmethod
from typing import Any, Callable, Iterator, Sequence

from .freelist import FreeList


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

    def hit_all(self, blocks: Sequence[Any]) -> None:
        """hit(b) for each of `blocks` in order (a lookup's run of evictable
        hits); a policy may do it in one pass."""
        for b in blocks:
            self.hit(b)

    @abstractmethod
    def pop(self) -> Any:
        """Unlink and return the next victim, or None."""

    @abstractmethod
    def __len__(self) -> int: ...

    @abstractmethod
    def __iter__(self) -> Iterator[Any]:
        """Blocks in the order they would be evicted."""


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

    def hit_all(self, blocks: Sequence[Any]) -> None:
        self._list.move_all_to_back(blocks)  # first: it raises before changing anything
        for b in blocks:
            b.hits += 1

    def pop(self) -> Any:
        return self._list.popleft()

    def __len__(self) -> int:
        return len(self._list)

    def __iter__(self) -> Iterator[Any]:
        return iter(self._list)


class HitsLRUPolicy(EvictionPolicy):
    """The seed's order: fewest hits first, then least recently used.

    One free list per hit count keeps each bucket in last-use order (a block
    enters at the back when it becomes evictable, which is its last use), so
    within a bucket the front is the coldest. A heap of hit counts finds the
    lowest non-empty bucket. remove() drops a bucket it empties, so a hot
    block climbing one hit count at a time leaves no trail of empty buckets;
    the heap entries of dropped buckets are skipped by pop() and compacted away
    once they outnumber the live buckets. add/remove are O(1) amortised, pop is
    O(1) amortised plus O(log distinct hit counts).
    The seed's third key (-size) only breaks ties of equal last use, which a
    single event clock never produces.
    """

    name = "hits-lru"

    def __init__(self) -> None:
        self._buckets: dict[int, FreeList] = {}
        self._heap: list[int] = []
        self._size = 0

    def add(self, block: Any) -> None:
        bucket = self._buckets.get(block.hits)
        if bucket is None:
            bucket = self._buckets[block.hits] = FreeList()
            heapq.heappush(self._heap, block.hits)
        bucket.append(block)
        self._size += 1

    def remove(self, block: Any) -> None:
        bucket = self._buckets[block.hits]
        bucket.remove(block)
        self._size -= 1
        if not len(bucket):
            del self._buckets[block.hits]
            bucket.discard_empty()
            if len(self._heap) > 2 * len(self._buckets) + 16:
                self._heap = list(self._buckets)
                heapq.heapify(self._heap)

    def hit(self, block: Any) -> None:
        self.remove(block)
        block.hits += 1
        self.add(block)

    def pop(self) -> Any:
        while self._heap:
            hits = self._heap[0]
            bucket = self._buckets.get(hits)
            if bucket is not None:
                node = bucket.popleft()
                if node is not None:
                    self._size -= 1
                    return node
                del self._buckets[hits]
                bucket.discard_empty()
            heapq.heappop(self._heap)
        return None

    def __len__(self) -> int:
        return self._size

    def __iter__(self) -> Iterator[Any]:
        for hits in sorted(self._buckets):
            yield from self._buckets[hits]


POLICIES: dict[str, Callable[[], EvictionPolicy]] = {
    LRUPolicy.name: LRUPolicy,
    HitsLRUPolicy.name: HitsLRUPolicy,
}


def make_policy(name: str) -> EvictionPolicy:
    try:
        return POLICIES[name]()
    except KeyError:
        raise ValueError(
            f"unknown eviction policy {name!r}; choose one of {sorted(POLICIES)}"
        ) from None
