"""Chain order on top of any eviction policy: leaves first, strays first.

Block keys are chained (a key names its whole prefix), so a block is only
ever matched through its parent: a block whose parent left the ledger is
stranded, never matchable again, only taking room. Two rules keep that out:

* A parent is not evicted before its cached children. The policy proposes a
  victim; one with cached children is parked instead, and leaves the parked
  list when its last child leaves (to `due`: the policy had chosen it
  already) or when it is hit (back to the policy); a block in `due` goes
  back to the policy when hit, and is parked again when it gets a cached
  child (a save under a prefix just read). Only when nothing but
  parked blocks is evictable (every evictable block is an ancestor of a
  pinned or pending one) is a parked block evicted.
* A block whose parent is gone is stranded, and so is its whole subtree: the
  moment a parent leaves (evicted, discarded, reclaimed, aborted), its
  subtree's evictable blocks move to `stray`, and those pinned or still being
  written go there when they become evictable, whatever the order of
  release and commit. `stray` is evicted before anything else (then `due`,
  the parents whose last child left).

The links: block.parent (a Block, None for a chain's first block or an
unknown parent, or GONE) and block.child, one cached child; a block with
more keeps the others in its namespace's `more_kids`. The ledger files them
(link() at reserve, drop() when a block leaves; see saves.py, books.py).
"""
from __future__ import annotations

from typing import Any, Iterator, Optional, Sequence

from .freelist import FreeList
from .recency import EvictionPolicy

# node.pq bits 4-5: where ChainPolicy holds a block; bit 6: stranded.
PLACE = 0x30
INNER, PARKED, DUE = 0x10, 0x20, 0x30
STRANDED = 0x40


class _Gone:
    """The parent of a stranded block: gone from the ledger."""

    __slots__ = ()

    def __repr__(self) -> str:
        return "GONE"

    def __reduce__(self) -> str:   # one of it: copies and pickles stay `is GONE`
        return "GONE"


GONE: Any = _Gone()


# ------------------------------------------------------------------ links
def link(child: Any, parent: Any) -> None:
    """File `child` under `parent` (a Block, None or GONE) as it is filed."""
    child.parent = parent
    if parent is None:
        return
    if parent is GONE or parent.pq & STRANDED:
        child.pq |= STRANDED
        if parent is GONE:
            return
    if parent.child is None:
        parent.child = child
    else:
        parent.ns.more_kids.setdefault(parent, set()).add(child)
    if parent.pq & (PLACE | STRANDED) == DUE:
        # A victim-in-waiting (its last child had left) has a child again:
        # it waits behind it, or the child would be stranded by its eviction.
        parent.tier.policy.repark(parent)


def children(b: Any) -> list[Any]:
    if b.child is None:
        return []
    return [b.child, *b.ns.more_kids.get(b, ())]


def unlink(b: Any) -> None:
    """`b` leaves the ledger: its parent loses a child (and, its last, is
    unparked), its subtree is stranded."""
    p = b.parent
    if p is not None and p is not GONE:
        more = p.ns.more_kids.get(p)
        if p.child is b:
            p.child = more.pop() if more else None
        elif more is not None:
            more.discard(b)
        if more is not None and not more:
            del p.ns.more_kids[p]
        if p.child is None and p.pq & PLACE == PARKED:
            p.tier.policy.unpark(p)
    b.parent = None
    if b.child is not None:
        kids = children(b)
        b.child = None
        b.ns.more_kids.pop(b, None)
        for c in kids:
            c.parent = GONE
            strand(c)


def strand(b: Any) -> None:
    """Mark `b`'s subtree stranded; move its evictable blocks to due."""
    if b.pq & STRANDED:
        # Its subtree is stranded already (link and strand mark whole
        # subtrees); moving it again would reorder `stray` behind the order
        # ChainPolicy.__iter__ reports.
        return
    todo = [b]
    while todo:
        x = todo.pop()
        if x.pq & STRANDED:
            continue
        if x.pq & PLACE:            # evictable: to the front of the order
            policy = x.tier.policy
            policy.remove(x)
            x.pq |= STRANDED
            policy.add(x)
        else:                       # pinned or being written: there once evictable
            x.pq |= STRANDED
        todo.extend(children(x))


def private_run(hit: Sequence[Any]) -> int:
    """How many blocks at the end of `hit` (a lookup's run, prefix order) its
    reader has to itself: none unless the last has no cached child (the
    lookup read down to a leaf); then the leaf and each block before it whose
    one cached child is the next (a conversation's history, up to where
    another conversation or message branched off). Their hits are rereads
    (EvictionPolicy.reread)."""
    if not hit or hit[-1].child is not None:
        return 0
    more = hit[-1].ns.more_kids
    it = reversed(hit)
    nxt = next(it)
    k = 1
    for b in it:   # a Match's whole run when it reads a conversation back: one pass
        if b.child is not nxt or b in more:
            break
        nxt = b
        k += 1
    return k


def stranded(b: Any) -> bool:
    """Whether a chain above `b` lost a block (recomputed: for invariants)."""
    p = b.parent
    while p is not None:
        if p is GONE:
            return True
        p = p.parent
    return False


# ------------------------------------------------------------------ the tier's policy
class ChainPolicy(EvictionPolicy):
    """A page tier's eviction order: `due`, then `inner`'s order with parents
    parked behind their children, then (only when nothing else is left) the
    parked. O(1) per operation, amortised like inner's."""

    def __init__(self, inner: EvictionPolicy) -> None:
        self.inner = inner
        self.name = inner.name
        self.stray = FreeList()    # stranded: evicted before anything else
        self.due = FreeList()      # unparked parents: the policy's victims already
        self.parked = FreeList()

    # --- moves of one block between the places
    def _place(self, b: Any, place: int) -> None:
        b.pq = (b.pq & ~PLACE) | place

    def _due_list(self, b: Any) -> FreeList:
        return self.stray if b.pq & STRANDED else self.due

    def add(self, block: Any) -> None:
        if block.pq & STRANDED:
            self.stray.append(block)
            self._place(block, DUE)
            return
        self.inner.add(block)
        self._place(block, INNER)

    def remove(self, block: Any) -> None:
        place = block.pq & PLACE
        if place == INNER:
            self.inner.remove(block)
        elif place == PARKED:
            self.parked.remove(block)
        elif place == DUE:
            self._due_list(block).remove(block)
        else:
            raise ValueError("node is not held by this policy")
        self._place(block, 0)

    def repark(self, block: Any) -> None:
        """A block in `due` got a cached child: parked again till it leaves."""
        self.due.remove(block)
        self.parked.append(block)
        self._place(block, PARKED)

    def unpark(self, block: Any) -> None:
        """`block`'s last cached child left: evict it next."""
        self.parked.remove(block)
        self.due.append(block)
        self._place(block, DUE)

    def hit(self, block: Any) -> None:
        self._read(block, self.inner.hit)

    def reread(self, block: Any) -> None:
        self._read(block, self.inner.reread)

    def _read(self, block: Any, inner_read: Any) -> None:
        place = block.pq & PLACE
        if place == INNER:
            inner_read(block)
        elif place == PARKED:     # used again: back into the policy's order
            self.parked.remove(block)
            self.inner.add(block)
            self._place(block, INNER)
            inner_read(block)
        elif place == DUE and not block.pq & STRANDED:   # read again: back into the order
            self.due.remove(block)
            self.inner.add(block)
            self._place(block, INNER)
            inner_read(block)
        elif place == DUE:
            block.hits += 1
        else:
            raise ValueError("node is not held by this policy")

    def demote(self, block: Any) -> None:
        """inner's demotion of a block in its order; a parked block has cached
        children, which go first anyway, and a due or stray one goes next."""
        if block.pq & PLACE == INNER:
            self.inner.demote(block)
        elif not block.pq & PLACE:
            raise ValueError("node is not held by this policy")

    def hit_all(self, blocks: Sequence[Any], rereads: int = 0) -> None:
        if not self.parked and not self.due and not self.stray:   # all inner's: one pass
            self.inner.hit_all(blocks, rereads)
            return
        for i, b in enumerate(blocks):
            self._read(b, self.inner.reread if i < rereads else self.inner.hit)

    def pop(self) -> Any:
        b = self.stray.popleft()
        if b is None:
            b = self.due.popleft()
        if b is None:
            inner = self.inner
            while True:
                b = inner.pop()
                if b is None:
                    b = self.parked.popleft()   # forced: only ancestors of pinned blocks left
                    break
                if b.child is None:
                    break
                self.parked.append(b)
                self._place(b, PARKED)
        if b is not None:
            self._place(b, 0)
        return b

    def admits(self, node: Any, key: Any, hits: int) -> bool:
        return self.inner.admits(node, key, hits)

    def admit_run(self, keys: Sequence[Any], parent: Any, evicts: bool) -> str:
        return self.inner.admit_run(keys, parent, evicts)

    def __len__(self) -> int:
        return len(self.stray) + len(self.due) + len(self.inner) + len(self.parked)

    def __iter__(self) -> Iterator[Any]:
        """pop()'s order, simulated: how many cached children each block has
        left as the victims before it go, and which parked block that frees."""
        stray = list(self.stray)
        due = list(self.due)
        parked = list(self.parked)
        parked_ids = {id(b) for b in parked}
        left: dict[int, int] = {}
        gone: set[int] = set()

        def kids(b: Any) -> int:
            n = left.get(id(b))
            if n is None:
                n = left[id(b)] = len(children(b))
            return n

        def leave(b: Any) -> Optional[Any]:
            gone.add(id(b))
            p = b.parent
            if p is not None and p is not GONE and id(p) not in gone:
                left[id(p)] = kids(p) - 1
                if left[id(p)] == 0 and id(p) in parked_ids:
                    parked_ids.discard(id(p))
                    return p
            return None

        def drain_due() -> Iterator[Any]:
            while stray or due:
                b = (stray or due).pop(0)
                yield b
                freed = leave(b)
                if freed is not None:
                    due.append(freed)

        yield from drain_due()
        for b in self.inner:
            if kids(b):
                parked.append(b)
                parked_ids.add(id(b))
                continue
            yield b
            freed = leave(b)
            if freed is not None:
                due.append(freed)
            yield from drain_due()
        for b in parked:
            if id(b) not in parked_ids:
                continue
            parked_ids.discard(id(b))
            yield b
            gone.add(id(b))
            freed = leave(b)
            if freed is not None:
                due.append(freed)
            # Its subtree is stranded: what of it is parked goes first (as strand()).
            for c in children(b):
                todo = [c]
                while todo:
                    x = todo.pop()
                    if id(x) in parked_ids:
                        parked_ids.discard(id(x))
                        stray.append(x)
                    todo.extend(children(x))
            yield from drain_due()
