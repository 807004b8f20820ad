"""The copies below that an eviction is deleting, or deleted while a lookup's
probe was out.

A book evicts a copy at once, but its file (or cluster key) goes later, on
the tier's threads. Two things must not see it meanwhile:
* a flush writing the same key again: it waits for the delete (`pending`),
  else the late delete, by path, would remove the copy just acknowledged;
* a lookup's probe of a medium below: it asks the medium on a thread, and
  an answer "there" given before the delete ended must not be adopted into
  the book after it. The book would then list a copy that is gone, and a
  write-through save of that key would find it "already below" and be
  acknowledged with nothing written.

So each probe notes how many deletes had ended when it started
(`probe_started`), and a copy whose delete is still pending, or ended after
that, is stale to it (`stale`): the probe treats it as missing. Deletes that
ended are remembered only while a probe that started before them is out.
"""
from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any, Iterable

__all__ = ["Deletes"]

Where = tuple[bytes, bytes]
Mark = tuple[Any, Where]   # (tier name, (namespace id, key))

# Past this many remembered deletes, those no probe out can need are dropped
# (then past twice what stayed: a slow probe costs no scan per probe).
PRUNE_ABOVE = 1024


class Deletes:
    def __init__(self) -> None:
        self.pending: dict[Mark, asyncio.Event] = {}
        self._ended = 0                        # deletes ended so far
        self._ended_at: dict[Mark, int] = {}   # ended while probes were out: when
        self._probes: Counter[int] = Counter()   # probes out, by _ended at their start
        self._prune_at = PRUNE_ABOVE           # doubles with what a long probe keeps

    def begin(self, tier: Any, evicted: Iterable[Where]) -> tuple[list[Mark], asyncio.Event]:
        """Mark the copies an eviction is about to delete (before any await)."""
        done = asyncio.Event()
        marks = [(tier, w) for w in evicted]
        for m in marks:
            self.pending[m] = done
        return marks, done

    def end(self, marks: list[Mark], done: asyncio.Event) -> None:
        """Those deletes ended (or failed: the copy may be gone either way)."""
        self._ended += 1
        for m in marks:
            if self.pending.get(m) is done:
                del self.pending[m]
            if self._probes:
                self._ended_at[m] = self._ended
        done.set()

    def probe_started(self) -> int:
        """A probe goes out; its token for `stale` and `probe_ended`."""
        self._probes[self._ended] += 1
        return self._ended

    def stale(self, tier: Any, where: Where, since: int) -> bool:
        """Whether a probe that started at `since` may have seen a copy being
        deleted (call it synchronously, right before adopting the copy)."""
        m = (tier, where)
        return m in self.pending or self._ended_at.get(m, -1) > since

    def probe_ended(self, since: int) -> None:
        left = self._probes[since] - 1
        if left:
            self._probes[since] = left
        else:
            del self._probes[since]
        if not self._probes:
            self._ended_at.clear()
        elif len(self._ended_at) > self._prune_at:
            oldest = min(self._probes)
            self._ended_at = {m: n for m, n in self._ended_at.items() if n > oldest}
            self._prune_at = max(PRUNE_ABOVE, 2 * len(self._ended_at))
