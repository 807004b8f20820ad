"""Page allocator of one tier: which fixed-size pages are free.

A block takes whole pages, so any freed page serves any namespace and the
capacity check `free + evictable >= needed` is exact: no fragmentation can
make a reservation fail after evictions have started. A block's pages are an
int (the first page of a contiguous run) when they are contiguous, which is
the common case since a freed run is pushed back so that it pops out in the
same order, or a tuple of page numbers otherwise.
"""
from __future__ import annotations

from typing import Iterator, Union

Pages = Union[int, tuple[int, ...]]


class PageAllocator:
    __slots__ = ("total", "_free")

    def __init__(self, total_pages: int) -> None:
        if total_pages <= 0:
            raise ValueError("a tier needs at least one page")
        self.total = total_pages
        # A stack popped from the end; reversed so that pops go 0, 1, 2, ...
        self._free = list(range(total_pages - 1, -1, -1))

    @property
    def free_pages(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> Pages:
        """Take `n` pages. The caller has checked that enough are free."""
        free = self._free
        if n <= 0:
            # free[-0:] is the whole list: alloc(0) would silently take every page.
            raise ValueError(f"a block takes at least one page, asked for {n}")
        if n > len(free):
            raise ValueError(f"asked for {n} pages with {len(free)} free")
        if n == 1:
            return free.pop()
        taken = free[-n:]
        del free[-n:]
        taken.reverse()
        first = taken[0]
        if taken[-1] - first == n - 1 and all(p == first + i for i, p in enumerate(taken)):
            return first
        return tuple(taken)

    def free(self, pages: Pages, n: int) -> None:
        # Pushed in reverse so that the next alloc(n) returns the same run.
        if isinstance(pages, int):
            self._free.extend(range(pages + n - 1, pages - 1, -1))
        else:
            self._free.extend(reversed(pages))

    def free_set(self) -> set[int]:
        return set(self._free)


def iter_pages(pages: Pages, n: int) -> Iterator[int]:
    if isinstance(pages, int):
        return iter(range(pages, pages + n))
    return iter(pages)


def page_runs(pages: Pages, n: int) -> list[tuple[int, int]]:
    """(first page, page count) for each contiguous run, in block order."""
    if isinstance(pages, int):
        return [(pages, n)]
    runs: list[tuple[int, int]] = []
    for p in pages:
        if runs and runs[-1][0] + runs[-1][1] == p:
            runs[-1] = (runs[-1][0], runs[-1][1] + 1)
        else:
            runs.append((p, 1))
    return runs
