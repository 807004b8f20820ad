"""One step's loads: what fetching hands the load strategies, and what is
reported back to vLLM (the block ids to recompute) and to the scheduler
(each load's leading good blocks and corrupt positions)."""
from __future__ import annotations

import threading
from concurrent.futures import Future
from typing import Dict, List, Optional, Sequence, Set, Tuple

import torch

from ..metadata import LoadSpec
from ..stats import Counters
from .timings import LoadTimings

__all__ = ["FetchedLoad", "LoadResults", "StepLoads"]


class FetchedLoad:
    """One LoadSpec after its Match: a lease and views of its blocks in the arena."""

    __slots__ = ("spec", "lease_id", "n", "copy_n", "sources", "views", "sums", "checked",
                 "good", "bad")

    def __init__(self, spec: LoadSpec, lease_id: Optional[int], n: int,
                 sources: List[torch.Tensor], sums: List[Tuple[int, int]],
                 views: Optional[Sequence[Optional[memoryview]]] = None) -> None:
        self.spec = spec
        self.lease_id = lease_id        # None: the scheduler's lease covers it
        self.n = n                      # blocks to copy in: the leading matched ones
        self.copy_n = n                 # of those, copied by the step's copy job
        self.checked: Dict[int, bool] = {}   # blocks copied and checked already
        self.sources: Optional[List[torch.Tensor]] = sources
        # Per block, the same bytes as sources[i] as one memoryview (None: a
        # block of several pieces): hashed as they are, without the ~5 us a
        # tensor's .numpy() costs per block.
        self.views: Optional[Sequence[Optional[memoryview]]] = views
        self.sums = sums                # (algo, checksum) per block, as committed
        self.good = 0                   # leading blocks copied in and checked
        self.bad: List[int] = []        # lease positions that failed their checksum


class StepLoads:
    """The direct loads of one step: per-layer "copied" events (only for the
    layers a strategy copies beside the forward) and the job running them."""

    def __init__(self, fetched: List[FetchedLoad], layer_names: Sequence[str],
                 timings: LoadTimings) -> None:
        self.fetched = fetched
        self.layer_done = {name: threading.Event() for name in layer_names}
        self.timings = timings
        self.future: Optional["Future[None]"] = None   # the copies and checks beside the forward
        self.abandoned = False          # give up on every block (a timeout, a failed copy)
        self.released = False           # its views and leases handed back (BlockLoader.release)


class LoadResults:
    """Each load's outcome on this rank, until vLLM and the scheduler take it."""

    def __init__(self, rank: int, block_bytes: Optional[int], counters: Counters) -> None:
        self._rank = rank
        self._block_bytes = block_bytes   # None: disabled before a layout was known
        self._counters = counters
        self._invalid: Set[int] = set()
        self._done: Dict[int, Dict[int, Tuple[int, Tuple[int, ...]]]] = {}
        self._clean: Dict[int, bool] = {}   # load id -> all loaded, none corrupt (take_clean)

    def finish(self, spec: LoadSpec, good: int, bad: Sequence[int] = ()) -> None:
        """Load `spec` is over: its `good` leading blocks are in the KV cache,
        every later one is recomputed; `bad`: lease positions found corrupt."""
        n = spec.num_blocks()
        c = self._counters
        if good < n:
            self._invalid.update(spec.block_ids[good:])
            c.inc("load_errors")
            c.inc("load_error_blocks", n - good)
        if good and self._block_bytes is not None:
            c.inc("loaded_blocks", good)
            c.inc("loaded_bytes", good * self._block_bytes)
        self._done.setdefault(spec.load_id, {})[self._rank] = (good, tuple(bad))
        self._clean[spec.load_id] = good >= n and not bad

    def take_clean(self) -> Dict[int, bool]:
        """Load id -> whether this rank loaded all of it and found nothing
        corrupt, for the loads finished since the last call."""
        out, self._clean = self._clean, {}
        return out

    def take_invalid(self) -> Set[int]:
        """vLLM block ids to recompute, since the last call."""
        out, self._invalid = self._invalid, set()
        return out

    def take_done(self) -> Dict[int, Dict[int, Tuple[int, Tuple[int, ...]]]]:
        """Load id -> {rank: (good, corrupt positions)}, since the last call."""
        out, self._done = self._done, {}
        return out
