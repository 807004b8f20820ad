"""kvkeeper.server.ops.watch: eviction storms and tier errors, from counters."""
from __future__ import annotations

import logging
from collections import Counter
from types import SimpleNamespace

from kvkeeper.server.ops.watch import CounterWatch, EvictionStorm, Increases, WindowedDelta


def test_windowed_delta() -> None:
    w = WindowedDelta(10.0)
    assert w.observe(0.0, 5) == 0
    assert w.observe(5.0, 50) == 45
    assert w.observe(10.0, 60) == 55       # the sample at 0 is the window's start
    assert w.observe(15.0, 60) == 10       # from the sample at 5
    assert w.observe(100.0, 61) == 1


def test_storm_starts_once_and_ends_with_its_peak() -> None:
    s = EvictionStorm(100)
    assert s.observe(0.0, 0) is None
    assert s.observe(1.0, 50) is None
    assert s.observe(2.0, 150) == ("start", 150)
    assert s.observe(3.0, 400) is None         # still raging: logged once
    assert s.observe(20.0, 400) == ("end", 400)
    assert s.observe(21.0, 401) is None


def test_a_zero_threshold_disables_the_storm_watch() -> None:
    s = EvictionStorm(0)
    assert s.observe(0.0, 0) is None and s.observe(1.0, 10 ** 9) is None


def test_increases() -> None:
    inc = Increases()
    assert inc({"a": 1, "b": 2}) == {}
    assert inc({"a": 1, "b": 5}) == {"b": 3}
    assert inc({"a": 4, "b": 5}) == {"a": 3}


def fake_stack(evictions: Counter, disk: SimpleNamespace) -> SimpleNamespace:
    """The tier stack as CounterWatch reads it: every tier's book, the disk's errors."""
    return SimpleNamespace(
        tier_stats=lambda: [SimpleNamespace(evictions=evictions), disk.index],
        errors=lambda: {"disk": {"io_errors": disk.store.io_errors,
                                 "checksum_failures": disk.store.checksum_failures,
                                 "flush_failures": disk.flush_failures}})


def test_counter_watch_logs_storms_and_disk_errors(caplog) -> None:
    ev: Counter = Counter()
    store = SimpleNamespace(io_errors=0, checksum_failures=0)
    disk = SimpleNamespace(store=store, flush_failures=0,
                           index=SimpleNamespace(evictions=Counter()))
    w = CounterWatch(fake_stack(ev, disk), storm_blocks=10)
    with caplog.at_level(logging.INFO, logger="kvkeeper.watch"):
        ev["capacity"] += 6
        ev["admin"] += 100                     # an operator's evict is no storm
        w.tick(1.0)
        assert "storm" not in caplog.text
        disk.index.evictions["capacity"] += 6
        w.tick(2.0)
        store.checksum_failures += 2
        w.tick(3.0)
    storm = [r for r in caplog.records if getattr(r, "event", "") == "eviction_storm"]
    assert len(storm) == 1 and storm[0].evictions == 12
    errs = [r for r in caplog.records if getattr(r, "event", "") == "tier_error"]
    assert [(r.kind, r.count) for r in errs] == [("checksum_failures", 2)]
