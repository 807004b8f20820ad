"""Load gates: the outcome of each load, for the saves that wait for it.

A step that loads a request's hit also computes the blocks after it, by
attention over the loaded ones; their save names the loads still in flight
(SaveSpec.after_loads). With one rank the worker knows the outcome in the
same step (worker._own_outcomes). Otherwise the scheduler learns it from
every rank's report (KVKeeperWorkerMetadata.loads_done) and tells the
workers in a later step's metadata (load_outcomes), where the save thread
stores or drops what waited (save.py): only the scheduler sees every rank's
report, and with tensor parallelism one rank's failed load corrupts what
every rank computes after it (the all-reduce mixes the heads).
"""
from __future__ import annotations

import time
from typing import Callable, Dict, Iterable, Mapping, Set, Tuple

from .metadata import LoadSpec

__all__ = ["HOLD_S", "LoadGates"]

# The longest a finished request's free waits for its loads' outcomes (a
# worker that never reports them: the engine stopping).
HOLD_S = 30.0


class LoadGates:
    """A request that ends in its loading step keeps its blocks (its free is
    delayed: it has saves) until its loads' outcomes went out: vLLM steps on
    only while a finished request awaits its free, and with asynchronous
    scheduling the step after the loading one is planned before its reports
    arrive, so the outcome goes out a step later still (held())."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._blocks: Dict[int, int] = {}      # load id -> blocks it loads (planned)
        self._outcomes: Dict[int, bool] = {}   # load id -> clean (reported, not yet sent)
        self._held: Dict[str, Tuple[Set[int], float]] = {}   # req id -> (loads, until)

    def planned(self, load: LoadSpec) -> None:
        self._blocks[load.load_id] = load.num_blocks()

    def reported(self, loads_done: Mapping[int, Mapping[int, Tuple[int, Tuple[int, ...]]]]) -> None:
        """Every rank's (leading blocks loaded, corrupt positions) of each load."""
        for load_id, ranks in loads_done.items():
            n = self._blocks.pop(load_id, None)
            if n is not None:
                self._outcomes[load_id] = bool(ranks) and all(
                    good >= n and not bad for good, bad in ranks.values())

    def take(self) -> Dict[int, bool]:
        """The outcomes reported since the last call (for the next step's metadata)."""
        out, self._outcomes = self._outcomes, {}
        return out

    def hold(self, req_id: str, load_ids: Iterable[int]) -> None:
        """`req_id` ended with these loads unconfirmed (request_finished)."""
        pending = {i for i in load_ids if i in self._blocks or i in self._outcomes}
        if pending:
            self._held[req_id] = (pending, self._clock() + HOLD_S)

    def held(self, req_id: str) -> bool:
        """Whether `req_id`'s free must wait: a load of it not yet reported, or
        reported but not yet sent to the workers. Never raises."""
        entry = self._held.get(req_id)
        if entry is None:
            return False
        loads, until = entry
        if self._clock() < until and any(i in self._blocks or i in self._outcomes
                                         for i in loads):
            return True
        del self._held[req_id]
        return False
