"""Pages of reservations the daemon ended, kept out of use for a while.

A shared-memory writer copies into its reserved pages from its own process;
the daemon cannot stop it. When the daemon ends a reservation the writer did
not end itself (it timed out, or its session expired or was revoked), the
writer may be frozen mid-copy (SIGSTOP, a cgroup freeze, a swap storm) and
go on later. Pages freed at once could by then hold another client's
acknowledged blocks, which the late copy would overwrite: a load would then
fail its checksum (an acknowledged save lost) or, without checksums, serve
the wrong bytes. So such pages stay out of the free list until the
reservation's own deadline plus a grace period has passed. A reservation
its client aborted or committed, and a session its client closed, free
their pages at once: that client said it writes no more.
"""
from __future__ import annotations

import heapq
import itertools

from .pages import PageAllocator, Pages, iter_pages

__all__ = ["Cooling"]


class Cooling:
    def __init__(self, allocator: PageAllocator) -> None:
        self._allocator = allocator
        self._heap: list[tuple[float, int, Pages, int]] = []   # (until, seq, pages, n)
        self._seq = itertools.count()
        self.pages = 0          # pages out of use now
        self.cooled = 0         # monotonic: page runs ever cooled, for metrics and tests

    def add(self, pages: Pages, n: int, until: float) -> None:
        heapq.heappush(self._heap, (until, next(self._seq), pages, n))
        self.pages += n
        self.cooled += 1

    def thaw(self, now: float) -> int:
        """Free the pages whose time has come; how many."""
        freed = 0
        while self._heap and self._heap[0][0] <= now:
            _, _, pages, n = heapq.heappop(self._heap)
            self._allocator.free(pages, n)
            freed += n
        self.pages -= freed
        return freed

    def page_set(self) -> set[int]:
        """Every page out of use (for check_invariants: O(pages))."""
        return {p for _, _, pages, n in self._heap for p in iter_pages(pages, n)}
