"""The page allocator of a tier (server/ledger/pages.py)."""
from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkeeper.server.ledger.pages import PageAllocator, iter_pages, page_runs


def test_needs_at_least_one_page():
    with pytest.raises(ValueError, match="at least one page"):
        PageAllocator(0)
    with pytest.raises(ValueError):
        PageAllocator(-3)
    assert PageAllocator(1).free_pages == 1


def test_fresh_allocations_are_ascending_and_contiguous():
    a = PageAllocator(10)
    assert a.alloc(1) == 0
    assert a.alloc(3) == 1          # an int: the first page of a contiguous run 1..3
    assert a.alloc(2) == 4
    assert a.alloc(1) == 6
    assert a.free_pages == 3 and a.total == 10
    assert a.free_set() == {7, 8, 9}


def test_a_freed_run_is_reused_first_and_in_the_same_order():
    a = PageAllocator(8)
    first = a.alloc(3)
    a.alloc(2)
    a.free(first, 3)
    assert a.free_pages == 6
    assert a.alloc(3) == first      # LIFO reuse hands back the same contiguous run
    a.free(3, 2)
    assert a.alloc(1) == 3 and a.alloc(1) == 4


def test_fragmented_free_pages_come_back_as_a_tuple():
    a = PageAllocator(8)
    singles = [a.alloc(1) for _ in range(4)]
    assert singles == [0, 1, 2, 3]
    a.free(0, 1)
    a.free(2, 1)
    got = a.alloc(2)
    assert isinstance(got, tuple) and sorted(got) == [0, 2]
    assert list(iter_pages(got, 2)) == list(got)
    assert page_runs(got, 2) == [(p, 1) for p in got]
    # A freed tuple is handed back unchanged to the next alloc of its size.
    a.free(got, 2)
    assert a.alloc(2) == got


def test_a_run_that_only_looks_contiguous_at_its_ends_is_a_tuple():
    a = PageAllocator(6)
    for p in range(6):
        assert a.alloc(1) == p
    for p in (5, 1, 3):   # pops 3, 1, 5: ends differ by n-1 but the middle is 1
        a.free(p, 1)
    got = a.alloc(3)
    assert got == (3, 1, 5)


def test_overallocation_raises_and_takes_nothing():
    a = PageAllocator(4)
    a.alloc(3)
    with pytest.raises(ValueError, match="2 pages with 1 free"):
        a.alloc(2)
    assert a.free_pages == 1 and a.alloc(1) == 3


@pytest.mark.parametrize("n", [0, -1])
def test_non_positive_allocation_is_rejected_and_takes_nothing(n):
    a = PageAllocator(4)
    with pytest.raises(ValueError):
        a.alloc(n)
    assert a.free_pages == 4


def test_page_runs_of_an_int_and_of_tuples():
    assert page_runs(7, 3) == [(7, 3)]
    assert page_runs((3, 4, 5, 9, 10, 2), 6) == [(3, 3), (9, 2), (2, 1)]
    assert page_runs((5, 4), 2) == [(5, 1), (4, 1)]   # block order, not sorted
    assert list(iter_pages(4, 3)) == [4, 5, 6]


@settings(max_examples=150, deadline=None)
@given(st.lists(st.tuples(st.booleans(), st.integers(1, 4), st.integers(0, 50)), max_size=50))
def test_pages_are_never_shared_or_lost(ops):
    total = 12
    a = PageAllocator(total)
    owned: list[tuple[object, int]] = []
    for is_alloc, n, pick in ops:
        if is_alloc:
            if n > a.free_pages:
                with pytest.raises(ValueError):
                    a.alloc(n)
                continue
            pages = a.alloc(n)
            got = list(iter_pages(pages, n))
            assert len(got) == n
            if isinstance(pages, int):
                assert got == list(range(pages, pages + n))
            else:
                assert len(page_runs(pages, n)) > 1   # a tuple only when not contiguous
            assert sum(c for _, c in page_runs(pages, n)) == n
            owned.append((pages, n))
        elif owned:
            pages, n = owned.pop(pick % len(owned))
            a.free(pages, n)
        in_use = [p for pages, n in owned for p in iter_pages(pages, n)]
        assert len(in_use) == len(set(in_use))                  # no page in two blocks
        assert set(in_use).isdisjoint(a.free_set())            # no page both free and owned
        assert len(in_use) + a.free_pages == total              # nothing lost
        assert set(in_use) | a.free_set() == set(range(total))


class _PageStack:
    """The model: free pages as a stack of single pages (the allocator
    before runs). The run-based allocator must hand out exactly its pages."""

    def __init__(self, total: int) -> None:
        self.free = list(range(total - 1, -1, -1))

    def alloc(self, n: int) -> object:
        taken = self.free[-n:]
        del self.free[-n:]
        taken.reverse()
        if taken == list(range(taken[0], taken[0] + n)):
            return taken[0]
        return tuple(taken)

    def release(self, pages: object, n: int) -> None:
        self.free.extend(reversed(list(iter_pages(pages, n))))


@settings(max_examples=200, deadline=None)
@given(st.integers(1, 40),
       st.lists(st.tuples(st.booleans(), st.integers(1, 9), st.integers(0, 50)), max_size=80))
def test_runs_hand_out_exactly_the_pages_a_page_stack_would(total, ops):
    a, model = PageAllocator(total), _PageStack(total)
    owned: list[tuple[object, int]] = []
    for is_alloc, n, pick in ops:
        if is_alloc and n <= a.free_pages:
            got = a.alloc(n)
            assert got == model.alloc(n)
            owned.append((got, n))
        elif owned:
            pages, n = owned.pop(pick % len(owned))
            a.free(pages, n)
            model.release(pages, n)
        assert a.free_pages == len(model.free)
        assert a.free_set() == set(model.free)
