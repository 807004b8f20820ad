"""HalvesLoad: the I/O thread's share of each load follows the two threads'
measured copy rates, so that neither waits long for the other (the spare
core it runs on is the one vLLM's engine core busy-polls)."""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any, List

import pytest

pytest.importorskip("torch")

from kvkeeper.connector.io_thread import IoThread  # noqa: E402
from kvkeeper.connector.load.halves import HalvesLoad  # noqa: E402


class Loader:
    """Copies take `cost[thread]` seconds a block; records who copied what."""

    def __init__(self, main_cost: float, helper_cost: float) -> None:
        self.main = threading.get_ident()
        self.cost = (main_cost, helper_cost)
        self.copied: List[Any] = []
        self.released = 0

    def copy_check_in(self, f: Any, lo: int, hi: int) -> List[int]:
        mine = threading.get_ident() == self.main
        time.sleep((hi - lo) * self.cost[0 if mine else 1])
        self.copied.append(("main" if mine else "helper", lo, hi))
        return []

    def bad_in(self, f: Any, lo: int, hi: int) -> List[int]:
        return []

    def set_bad(self, f: Any, bad: List[int]) -> None:
        f.bad = bad

    def release(self, step: Any) -> None:
        self.released += 1


def _step(n: int) -> Any:
    f = SimpleNamespace(copy_n=n, n=n, sources=[object()] * n, bad=None)
    return SimpleNamespace(fetched=[f], timings=SimpleNamespace(copy=None, check=None),
                           abandoned=False)


def test_adapt_moves_halfway_to_the_balance_of_the_rates() -> None:
    h = HalvesLoad(Loader(0, 0), IoThread(None))   # type: ignore[arg-type]
    try:
        h._adapt(100, 1.0, 50, 1.0)          # the helper copies at half the rate
        assert h.share == pytest.approx((0.5 + 1 / 3) / 2)
        for _ in range(30):
            h._adapt(100, 1.0, 1, 1.0)
        assert h.share == h.min_share
        for _ in range(30):
            h._adapt(1, 1.0, 100, 1.0)
        assert h.share == h.max_share
        before = h.share
        h._adapt(0, 0.0, 10, 1.0)            # one side did nothing: no measurement
        assert h.share == before
    finally:
        h.io.shutdown()


def test_a_slow_helper_gets_fewer_blocks_and_every_block_is_copied_once() -> None:
    loader = Loader(main_cost=0.0005, helper_cost=0.0015)
    h = HalvesLoad(loader, IoThread(None))   # type: ignore[arg-type]
    try:
        for _ in range(6):
            loader.copied.clear()
            step = _step(40)
            h.start(step)
            spans = sorted((lo, hi) for _, lo, hi in loader.copied)
            assert spans[0][0] == 0 and spans[-1][1] == 40
            assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
            assert step.fetched[0].bad == [] and step.timings.copy is not None
        assert 0.1 <= h.share < 0.4            # ~1/4 where the helper is 3x slower
        assert loader.released == 6
    finally:
        h.io.shutdown()
