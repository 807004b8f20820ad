"""Intrusive doubly linked list with sentinels, after vLLM's FreeKVCacheBlockQueue.

The nodes are the blocks themselves (their `prev`/`next` slots), so append,
remove and popleft are O(1) and allocate nothing. Only unreferenced committed
blocks are ever linked in.
"""
from __future__ import annotations

from typing import Any, Iterator, Sequence


class _Sentinel:
    __slots__ = ("prev", "next")

    def __init__(self) -> None:
        self.prev: Any = None
        self.next: Any = None


class FreeList:
    __slots__ = ("_head", "_tail", "_size")

    def __init__(self) -> None:
        self._head = _Sentinel()
        self._tail = _Sentinel()
        self._head.next = self._tail
        self._tail.prev = self._head
        self._size = 0

    def __len__(self) -> int:
        return self._size

    def append(self, node: Any) -> None:
        """Link `node` at the back (most recently freed)."""
        if node.prev is not None or node.next is not None:
            raise ValueError("node is already linked in a free list")
        last = self._tail.prev
        last.next = node
        node.prev = last
        node.next = self._tail
        self._tail.prev = node
        self._size += 1

    def remove(self, node: Any) -> None:
        """Unlink `node` from wherever it is, in O(1)."""
        prev, nxt = node.prev, node.next
        if prev is None or nxt is None:
            raise ValueError("node is not linked in a free list")
        prev.next = nxt
        nxt.prev = prev
        node.prev = node.next = None
        self._size -= 1

    def move_to_back(self, node: Any) -> None:
        """remove(node) then append(node), in one step: the hot path of a hit."""
        prev, nxt = node.prev, node.next
        if prev is None or nxt is None:
            raise ValueError("node is not linked in a free list")
        prev.next = nxt
        nxt.prev = prev
        last = self._tail.prev
        last.next = node
        node.prev = last
        node.next = self._tail
        self._tail.prev = node

    def move_to_front(self, node: Any) -> None:
        """remove(node), then link it at the front: popleft's next (a demotion)."""
        self.remove(node)
        first = self._head.next
        self._head.next = node
        node.prev = self._head
        node.next = first
        first.prev = node
        self._size += 1

    def move_all_to_back(self, nodes: Sequence[Any]) -> None:
        """move_to_back(n) for each of `nodes` in order, in one pass: a lookup's
        run of hits. Raises ValueError, changing nothing, if one is not linked."""
        tail = self._tail
        # Already the last nodes, in this order (a prefix matched again and
        # nothing else touched since): the moves would change nothing.
        node = tail
        for n in reversed(nodes):
            node = node.prev
            if node is not n:
                break
        else:
            return
        for n in nodes:
            if n.prev is None or n.next is None:
                raise ValueError("node is not linked in a free list")
        if len(set(nodes)) != len(nodes):
            # A node named twice ends where its last move puts it.
            for n in nodes:
                self.move_to_back(n)
            return
        for n in nodes:
            prev, nxt = n.prev, n.next
            prev.next = nxt
            nxt.prev = prev
        last = tail.prev
        for n in nodes:
            last.next = n
            n.prev = last
            last = n
        last.next = tail
        tail.prev = last

    def discard_empty(self) -> None:
        """Break the sentinels' cycle of an empty list that is being dropped, so
        that reference counting frees it: the cyclic GC may never look at it
        again once it is frozen (see server/ops/gcpolicy.py)."""
        if self._size:
            raise ValueError(f"the list still holds {self._size} nodes")
        self._head.next = None
        self._tail.prev = None

    def popleft(self) -> Any:
        """Unlink and return the front node (least recently freed), or None."""
        node = self._head.next
        if node is self._tail:
            return None
        self.remove(node)
        return node

    def peekleft(self) -> Any:
        node = self._head.next
        return None if node is self._tail else node

    def __iter__(self) -> Iterator[Any]:
        node = self._head.next
        while node is not self._tail:
            nxt = node.next
            yield node
            node = nxt
