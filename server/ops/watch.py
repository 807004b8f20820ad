"""Log lines for what only counters show: eviction storms and tier errors.

The reaper calls CounterWatch.tick() about once a second. Each watch compares
monotonic counters with what it saw before, so nothing on the request path
pays for it, and each event is logged once rather than once per block.
"""
from __future__ import annotations

import logging
from collections import deque
from typing import Any, Optional

from ..ledger import ROOM_REASONS

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
    """`stack`: the tier stack (tiers/stack.py), read for every tier's book and errors."""

    def __init__(self, stack: Any, *, storm_blocks: int) -> None:
        self.stack = stack
        self.storm = EvictionStorm(storm_blocks)
        self.tier_errors: dict[str, Increases] = {}
        self.tick(0.0)  # the base for later increases

    def _capacity_evictions(self) -> int:
        # Demoted blocks were evicted for room too: a storm is capacity pressure.
        return sum(t.evictions.get(r, 0) for t in self.stack.tier_stats() for r in ROOM_REASONS)

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
        for tier, counters in self.stack.errors().items():
            grew = self.tier_errors.setdefault(tier, Increases())(counters)
            for name, n in grew.items():
                log.warning("%s tier: %d new %s", tier, n, name.replace("_", " "),
                            extra={"event": "tier_error", "tier": tier, "kind": name,
                                   "count": n})
