"""HalvesLoad: before the forward, with the I/O thread (on the one spare
core) copying and checking the second half of every load while vLLM's
thread does the first, each a block at a time (copied, then hashed while
its source is in the cache): copies (memmove) and checksums run without
the GIL, so the two overlap. Small steps are copied inline: below min_blocks, handing half to
the I/O thread costs more than it saves."""
from __future__ import annotations

import logging
import time
from typing import List, Optional, Tuple

from .inline import InlineLoad
from .step import FetchedLoad, StepLoads

__all__ = ["HalvesLoad"]

log = logging.getLogger("kvkeeper.connector")

_Part = Tuple[FetchedLoad, int, int]   # a load's blocks lo..hi-1


class HalvesLoad(InlineLoad):
    name = "halves"
    min_blocks = 8

    def start(self, step: StepLoads) -> None:
        if sum(f.copy_n for f in step.fetched) < self.min_blocks:
            super().start(step)
            return
        loader, io = self.loader, self.io
        t0 = time.perf_counter()
        mine: List[_Part] = []
        theirs: List[_Part] = []
        for f in step.fetched:
            half = f.copy_n // 2
            mine.append((f, 0, half))
            theirs.append((f, half, f.copy_n))

        def work(parts: List[_Part]) -> List[List[int]]:
            out = []
            for f, lo, hi in parts:
                if step.abandoned:   # the other half failed: write no more
                    out.append(loader.bad_in(f, lo, hi))
                elif lo < hi and f.sources:
                    out.append(loader.copy_check_in(f, lo, hi))
                else:
                    out.append(loader.bad_in(f, lo, hi))
            return out

        bad: Optional[List[List[int]]] = None
        fut = io.submit(work, theirs)
        try:
            first = work(mine)
            second = fut.result(timeout=io.wait_s)
            bad = [a + b for a, b in zip(first, second)]
        except BaseException as e:  # noqa: BLE001 - a failed copy: recompute all of it
            log.warning("kvkeeper: copying loaded blocks into the KV cache failed: %s", e,
                        exc_info=True)
            step.abandoned = True
            if not fut.cancel():   # never leave the helper writing into the KV cache
                try:                # (it stops at its next load: step.abandoned)
                    fut.result(timeout=10 * io.wait_s)
                except BaseException:  # noqa: BLE001
                    pass
        if bad is not None:
            for f, b in zip(step.fetched, bad):
                loader.set_bad(f, b + loader.bad_in(f, f.copy_n, f.n))
        loader.release(step)
        step.timings.copy = step.timings.check = time.perf_counter() - t0
