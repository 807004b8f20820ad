"""HalvesLoad: before the forward, with the I/O thread (on the one spare
core) copying and checking the tail of every load while vLLM's thread does
the head, each a block at a time (copied, then hashed while its source is
in the cache): copies (memmove) and checksums run without the GIL, so the
two overlap. How much each takes follows their measured rates (`share`).
Small steps are copied inline: below min_blocks, handing a part to the I/O
thread costs more than it saves."""
from __future__ import annotations

import logging
import time
from typing import List, Optional, Tuple

from ..io_thread import IoThread
from .copy_in import BlockLoader
from .inline import InlineLoad
from .step import FetchedLoad, StepLoads

__all__ = ["HalvesLoad"]

log = logging.getLogger("kvkeeper.connector")

_Part = Tuple[FetchedLoad, int, int]   # a load's blocks lo..hi-1


class HalvesLoad(InlineLoad):
    name = "halves"
    min_blocks = 8
    # The helper's share of each load's blocks: adapted after every step to
    # the two threads' measured copy rates, so that both finish together. The
    # spare core is the one vLLM's engine core busy-polls while it waits for
    # the step: an even split left vLLM's thread idle while the I/O thread,
    # sharing its core, still copied.
    min_share, max_share = 0.1, 0.9

    def __init__(self, loader: BlockLoader, io: IoThread) -> None:
        super().__init__(loader, io)
        self.share = 0.5

    def start(self, step: StepLoads) -> None:
        if sum(f.copy_n for f in step.fetched) < self.min_blocks:
            super().start(step)
            return
        loader, io = self.loader, self.io
        t0 = time.perf_counter()
        mine: List[_Part] = []
        theirs: List[_Part] = []
        for f in step.fetched:
            cut = f.copy_n - round(f.copy_n * self.share)
            mine.append((f, 0, cut))
            theirs.append((f, cut, f.copy_n))

        def work(parts: List[_Part]) -> Tuple[List[List[int]], float]:
            t = time.perf_counter()
            out = []
            for f, lo, hi in parts:
                if lo < hi and f.sources:
                    out.append(loader.copy_check_in(f, lo, hi))
                else:
                    out.append(loader.bad_in(f, lo, hi))
            return out, time.perf_counter() - t

        bad: Optional[List[List[int]]] = None
        fut = io.submit(work, theirs)
        try:
            first, t_mine = work(mine)
            second, t_theirs = fut.result(timeout=io.wait_s)
            bad = [a + b for a, b in zip(first, second)]
            self._adapt(_blocks(mine), t_mine, _blocks(theirs), t_theirs)
        except BaseException as e:  # noqa: BLE001 - a failed copy: recompute all of it
            log.warning("kvkeeper: copying loaded blocks into the KV cache failed: %s", e,
                        exc_info=True)
            step.abandoned = True
            try:   # never leave the helper writing into the KV cache
                fut.result(timeout=io.wait_s)
            except BaseException:  # noqa: BLE001
                pass
        if bad is not None:
            for f, b in zip(step.fetched, bad):
                loader.set_bad(f, b + loader.bad_in(f, f.copy_n, f.n))
        loader.release(step)
        step.timings.copy = step.timings.check = time.perf_counter() - t0

    def _adapt(self, n_mine: int, t_mine: float, n_theirs: int, t_theirs: float) -> None:
        """Move the helper's share halfway to where both threads would have
        finished together at the rates this step measured."""
        if n_mine <= 0 or n_theirs <= 0 or t_mine <= 0 or t_theirs <= 0:
            return
        r_mine, r_theirs = n_mine / t_mine, n_theirs / t_theirs
        target = r_theirs / (r_mine + r_theirs)
        self.share = min(self.max_share, max(self.min_share, (self.share + target) / 2))


def _blocks(parts: List[_Part]) -> int:
    return sum(hi - lo for _, lo, hi in parts)
