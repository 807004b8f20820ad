"""Log lines for what only counters show: eviction storms and tier errors.

The reaper calls CounterWatch.tick() about once a second. Each watch compares
monotonic counters with what it saw before, so nothing on the request path
pays for it, and each event is logged once rather than once per block.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Optional

log = logging.getLogger("kvkeeper.watch")

STORM_WINDOW_S = 10.0


class WindowedDelta:
    """How much a monotonic counter grew over the last `window_s` seconds (pure)."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()

    def observe(self, now: float, total: int) -> int:
        self._samples.append((now, total))
        # Keep the newest sample at or before the window's start as the base.
        while len(self._samples) > 1 and self._samples[1][0] <= now - self.window_s:
            self._samples.popleft()
        return total - self._samples[0][1]


class EvictionStorm:
    """Says when capacity evictions within the window rise above `threshold`
    ("start") and when they fall back ("end"); None otherwise. 0 disables."""

    def __init__(self, threshold: int, window_s: float = STORM_WINDOW_S) -> None:
        self.threshold = threshold
        self.window = WindowedDelta(window_s)
        self.active = False
        self.peak = 0

    def observe(self, now: float, total: int) -> Optional[tuple[str, int]]:
        n = self.window.observe(now, total)
        if not self.threshold:
            self.active = False
            return None
        if n > self.threshold and not self.active:
            self.active, self.peak = True, n
            return ("start", n)
        if self.active:
            self.peak = max(self.peak, n)
            if n <= self.threshold:
                self.active = False
                return ("end", self.peak)
        return None


class Increases:
    """Which named counters grew since the last call, and by how much (pure)."""

    def __init__(self) -> None:
        self._last: dict[str, int] = {}

    def __call__(self, counters: dict[str, int]) -> dict[str, int]:
        out = {k: v - self._last[k] for k, v in counters.items()
               if k in self._last and v > self._last[k]}
        self._last = dict(counters)
        return out


class CounterWatch:
    def __init__(self, ledger: Any, disk: Any = None, *, storm_blocks: int) -> None:
        self.ledger = ledger
        self.disk = disk
        self.storm = EvictionStorm(storm_blocks)
        self.disk_errors = Increases()
        self.tick(0.0)  # the base for later increases

    def _capacity_evictions(self) -> int:
        n = sum(t.evictions.get("capacity", 0) for t in self.ledger.tiers.values())
        if self.disk is not None:
            n += self.disk.index.evictions.get("capacity", 0)
        return n

    def tick(self, now: float) -> None:
        event = self.storm.observe(now, self._capacity_evictions())
        if event is not None:
            what, n = event
            if what == "start":
                log.warning("eviction storm: %d blocks evicted for capacity in the last %gs "
                            "(threshold %d): the cache turns over faster than it is reused; "
                            "raise the capacity or lower the load", n, STORM_WINDOW_S,
                            self.storm.threshold,
                            extra={"event": "eviction_storm", "evictions": n})
            else:
                log.info("eviction storm over (peak %d blocks in %gs)", n, STORM_WINDOW_S,
                         extra={"event": "eviction_storm_end", "peak": n})
        if self.disk is not None:
            st = self.disk.store
            grew = self.disk_errors({"io_errors": st.io_errors,
                                     "checksum_failures": st.checksum_failures,
                                     "flush_failures": self.disk.flush_failures})
            for name, n in grew.items():
                log.warning("disk tier: %d new %s", n, name.replace("_", " "),
                            extra={"event": "tier_error", "tier": "disk", "kind": name,
                                   "count": n})
