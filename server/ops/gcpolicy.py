"""When CPython's cyclic GC may run: never a full pass over the resident blocks.

Why. The ledger holds one GC-tracked `Block` per resident block (and the disk
tier one entry per block on disk). A full collection walks every tracked
object: about 150-180 ms at 1M resident blocks on CPython 3.11, during which
the event loop serves nothing. CPython starts one by itself, inside whichever
allocation crosses its thresholds, once the objects promoted to the oldest
generation since the last full pass exceed a quarter of that generation
(`long_lived_pending > long_lived_total / 4`): under churn, every ~250k new
blocks at 1M resident.

What this does (process-wide: the GC belongs to the interpreter):

* `settle()`, once the daemon is built (ledger, arena, disk tier recovered):
  one full collection, then `gc.freeze()`. Everything alive moves to the
  permanent generation, which no collection walks. `gc.freeze()` itself is
  O(1): CPython splices its generation lists.
* thresholds: the young ones as found (CPython's 700, 10); the third is
  raised to GEN2_THRESHOLD gen1 collections, so CPython's own full
  collections do not start while ticks come (after a freeze `long_lived_total` is small, so with
  the default of 10 a full pass would start every ~10 gen1 collections and
  walk whatever survived since the last freeze, inside a request).
* `tick(now)`, from a timer task of the daemon, between requests: every
  `interval_s`, `gc.collect()` (a full collection, but it walks only what is
  not frozen, i.e. what survived since the previous tick: O(churn), not
  O(resident blocks)), then `gc.freeze()` again.
* `release()`: `gc.unfreeze()` and the thresholds found at `settle()`
  (daemon stop, turning the option off by reload). One daemon per process is
  the case this is made for: of two in one process (tests), the first to stop
  unfreezes for both, and the other freezes again at its next tick.

Leak risk. The GC never examines a frozen object again, so a reference cycle
that is alive at a freeze and becomes garbage later is never reclaimed until
`release()`. Objects without cycles are freed by reference counting as usual
(an evicted block goes the moment the ledger drops it, frozen or not), and
collecting just before each freeze means nothing that is already garbage
gets frozen. The ledger's operations create no cyclic garbage
(tests/server/ops/test_gcpolicy.py checks register, match, lease, reserve,
commit, abort, release, discard, evict, expire and their errors), so what can
leak is a cycle owned by work in flight at a tick that only becomes garbage
afterwards (the RPC error path was one: see api.status.set_status).
"""
from __future__ import annotations

import gc
import math
import time
from dataclasses import dataclass
from typing import Optional

# Gen1 collections between two of CPython's own full collections. A tick resets
# the count, so with ticks every second this is never reached; if ticks stop
# (interval raised by hand, a stuck loop) CPython's full passes come back, each
# walking only what is not frozen.
GEN2_THRESHOLD = 1000


@dataclass(frozen=True)
class TickReport:
    collected: int          # unreachable objects found among the un-frozen ones
    seconds: float          # how long the collection and the freeze took


class GcPolicy:
    """Collect once and freeze after start-up; re-freeze every `interval_s`.

    `interval_s` 0 leaves CPython's GC untouched (settle/tick/release do nothing).
    """

    def __init__(self, interval_s: float) -> None:
        self._check(interval_s)
        self.interval_s = float(interval_s)
        self._saved: Optional[tuple[int, int, int]] = None   # thresholds before settle()
        self._last_tick = -math.inf
        self.ticks = 0

    @staticmethod
    def _check(interval_s: float) -> None:
        if not (isinstance(interval_s, (int, float)) and math.isfinite(interval_s)
                and interval_s >= 0):
            raise ValueError(f"gc freeze interval must be a finite number of seconds >= 0, "
                             f"got {interval_s!r}")

    @property
    def active(self) -> bool:
        """settle() ran and release() did not: the thresholds are ours, the heap is frozen."""
        return self._saved is not None

    @property
    def frozen_objects(self) -> int:
        """Size of the permanent generation. O(frozen objects): CPython counts its
        list (~10 ms at 1M blocks), so never read on a tick."""
        return gc.get_freeze_count()

    def settle(self, now: float) -> Optional[TickReport]:
        """After start-up and recovery: collect once, freeze, take the thresholds."""
        if self.interval_s == 0:
            return None
        if self._saved is None:
            self._saved = gc.get_threshold()
        t0, t1, _ = self._saved
        gc.set_threshold(t0, t1, GEN2_THRESHOLD)
        return self._refreeze(now)

    def due(self, now: float) -> bool:
        return self.active and now - self._last_tick >= self.interval_s

    def tick(self, now: float) -> Optional[TickReport]:
        """Between requests: when due, collect what is not frozen and freeze it."""
        if not self.due(now):
            return None
        return self._refreeze(now)

    def _refreeze(self, now: float) -> TickReport:
        t = time.perf_counter()
        collected = gc.collect()
        gc.freeze()
        seconds = time.perf_counter() - t
        self._last_tick = now
        self.ticks += 1
        return TickReport(collected, seconds)

    def release(self) -> None:
        """Everything back to CPython: unfreeze (the next full pass walks it all again)."""
        if self._saved is None:
            return
        gc.unfreeze()
        gc.set_threshold(*self._saved)
        self._saved = None
        self._last_tick = -math.inf

    def set_interval(self, interval_s: float, now: float) -> None:
        """A reload: 0 releases now; from 0 to a positive value settles now."""
        self._check(interval_s)
        was = self.interval_s
        self.interval_s = float(interval_s)
        if interval_s == 0:
            self.release()
        elif was == 0:
            self.settle(now)
