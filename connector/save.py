"""The worker's save thread: queued blocks copied out of the KV cache and sent.

wait_for_save (after the forward) only queues the step's SaveSpecs as
SaveJobs; one thread copies their blocks out of the KV cache into a staging
tensor and sends them (client.save: reserve, write, commit with checksums).
Until a job is copied out vLLM must not reuse its blocks, so whoever needs
them first (vLLM about to free or rewrite them) copies it out itself
(SaveJob.copy_out runs once). At most max_bytes may be queued; beyond it,
and while the daemon is unreachable, saves are dropped and counted (a lost
save is only a future miss).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from collections import OrderedDict
from concurrent.futures import Future
from typing import Any, List, Mapping, Optional, Sequence

import torch

from kvkeeper.client import ResourceExhaustedError

from .blocks import BlockCodec
from .cpus import use_spare_cpus
from .gpu import device_saves_for
from .link import DaemonLink, LinkDown
from .stats import Counters

__all__ = ["SaveJob", "SaveThread"]

log = logging.getLogger("kvkeeper.connector")

_STOP = object()
# A save computed over a load waits at most this long for the load's outcome:
# with one rank the worker knows it at once; with several it comes with the
# scheduler's next step, which may wait for the next request. The outcomes
# of this many loads are kept for the saves that may still ask.
OUTCOME_WAIT_S = 120.0
OUTCOMES_KEPT = 4096


class SaveJob:
    """One SaveSpec on this rank: copied out of the KV cache exactly once, by
    the save thread or, when vLLM is about to reuse the blocks, by whoever
    needs it done first."""

    __slots__ = ("req_id", "keys", "parent", "block_ids", "rows", "copied", "device", "_lock",
                 "after_loads")

    def __init__(self, req_id: str, keys: Sequence[bytes], block_ids: Sequence[int],
                 parent: Optional[bytes] = None, after_loads: Sequence[int] = ()) -> None:
        self.req_id = req_id
        self.after_loads = tuple(after_loads)   # stored once these are clean (load_gates.py)
        self.keys = list(keys)
        self.parent = parent   # the key before keys[0] in its chain; None: unknown
        self.block_ids = tuple(block_ids)
        self.rows: Optional[Any] = None   # host rows (a gpu.d2h.DeviceRows on CUDA)
        self.copied = False
        self.device: Optional[Any] = None  # KV cache on CUDA: its gpu.d2h.SaveOrder
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def copy_out(self, codec: BlockCodec, counters: Counters) -> None:
        with self._lock:
            if self.copied:
                return
            try:
                if self.device is not None:   # queued behind the forward, on a side stream
                    self.rows = self.device.copy_out(codec, self.block_ids)
                    return
                rows = codec.new_rows(len(self.block_ids))
                codec.gather(self.block_ids, rows)
                self.rows = rows
            except Exception as e:  # noqa: BLE001 - a lost save is a future miss
                log.warning("kvkeeper: copying %d block(s) of %s out of the KV cache failed: %s",
                            len(self.block_ids), self.req_id, e)
                counters.inc("save_errors")
            finally:
                self.copied = True


class SaveThread:
    """One thread copying queued blocks out of the KV cache and sending them;
    at most max_bytes queued at a time."""

    def __init__(self, link: DaemonLink, codec: BlockCodec, max_bytes: int,
                 counters: Counters, ready: "Optional[Future[None]]" = None,
                 waits_for_word: bool = False) -> None:
        self._link = link
        self._ready = ready   # the first connection (made on the I/O thread)
        self._codec = codec
        self._bb = codec.block_bytes
        self._max = max_bytes
        self._counters = counters
        self._q: "queue.Queue[object]" = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Event()
        self._idle.set()
        self._thread: Optional[threading.Thread] = None
        self._device = device_saves_for(codec)   # None unless the KV cache is on CUDA
        # Load id -> clean, from the scheduler (load_gates.py), oldest first.
        self._outcomes: "OrderedDict[int, bool]" = OrderedDict()
        self._told = threading.Condition()
        self._closing = False
        # Several ranks: an outcome comes with the scheduler's later step, so a
        # save waits for it. One rank: the worker fed it before the save was
        # queued (worker._own_outcomes), so one still unknown is a load that
        # never ended here: dropped at once, never blocking the saves behind.
        self.waits_for_word = waits_for_word

    def admit(self, nbytes: int) -> bool:
        """Reserve room for nbytes of queued saves; False when full."""
        with self._lock:
            if self._pending + nbytes > self._max:
                return False
            self._pending += nbytes
            self._idle.clear()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="kvkeeper-save",
                                                daemon=True)
                self._thread.start()
            return True

    def submit(self, job: SaveJob) -> None:
        if self._device is not None:   # on vLLM's thread, after the forward was issued
            job.device = self._device.mark()
        self._q.put(job)

    def outcomes(self, told: Mapping[int, bool]) -> None:
        """Loads' outcomes (a step's metadata): the saves waiting for them go on."""
        if not told:
            return
        with self._told:
            self._outcomes.update(told)
            while len(self._outcomes) > OUTCOMES_KEPT:
                self._outcomes.popitem(last=False)
            self._told.notify_all()

    def known_clean(self, load_ids: Sequence[int]) -> bool:
        """Whether every one of these loads is known clean now (no waiting)."""
        with self._told:
            return all(self._outcomes.get(i) is True for i in load_ids)

    def _clean(self, job: SaveJob) -> bool:
        """Whether every load the job's blocks were computed over is reported
        clean; waits for the outcomes (they come with the next step)."""
        deadline = time.monotonic() + OUTCOME_WAIT_S
        with self._told:
            while True:
                known = [self._outcomes.get(i) for i in job.after_loads]
                if None not in known:
                    return all(known)
                if not self.waits_for_word:
                    return False
                left = deadline - time.monotonic()
                if left <= 0 or self._closing:
                    return False   # never told (the engine stops): not stored
                self._told.wait(left)

    def _done(self, nbytes: int) -> None:
        with self._lock:
            self._pending -= nbytes
            if self._pending <= 0:
                self._pending = 0
                self._idle.set()

    def flush(self, timeout: float) -> bool:
        return self._idle.wait(timeout)

    def close(self, timeout: float) -> None:
        with self._told:   # saves still waiting for an outcome will not get one
            self._closing = True
            self._told.notify_all()
        self.flush(timeout)
        with self._lock:
            if self._thread is not None:
                self._q.put(_STOP)

    def _run(self) -> None:
        use_spare_cpus()
        if self._ready is not None:
            try:   # else the first saves find the link "connecting" and are dropped
                self._ready.result(timeout=30.0)
            except Exception:  # noqa: BLE001 - the link reports and retries by itself
                pass
        while True:
            job = self._q.get()
            if job is _STOP:
                return
            assert isinstance(job, SaveJob)
            try:
                job.copy_out(self._codec, self._counters)
                rows, job.rows = job.rows, None
                if rows is not None and job.after_loads and not self._clean(job):
                    # Computed over a load that failed: wrong KV, never stored.
                    self._counters.inc("save_dropped_blocks", job.num_blocks)
                    rows = None
                if rows is not None:
                    self.send(job.keys, rows if job.device is None else rows.host(), job.parent)
            except Exception as e:  # noqa: BLE001 - keep the thread alive
                log.warning("kvkeeper: saving blocks of %s failed: %s", job.req_id, e)
            finally:
                self._done(job.num_blocks * self._bb)

    def send(self, keys: List[bytes], rows: torch.Tensor, parent: Optional[bytes] = None) -> None:
        """Save one job's copied-out rows under keys, a run of one chain after
        `parent` (on the save thread)."""
        c = self._counters
        n = len(keys)
        arr = rows.numpy()
        bufs = [arr[i] for i in range(n)]
        try:
            res = self._link.call(lambda cl: cl.save(keys, bufs, parent), "save")
        except LinkDown:
            c.inc("save_dropped_blocks", n)
            return
        except ResourceExhaustedError as e:
            log.debug("kvkeeper: %d block(s) not saved (daemon full, or it refused this engine): %s",
                      n, e)
            c.inc("save_dropped_blocks", n)
            return
        except Exception as e:  # noqa: BLE001 - a lost save is a future miss
            log.debug("kvkeeper: saving %d block(s) failed: %s", n, e)
            c.inc("save_errors")
            c.inc("save_dropped_blocks", n)
            return
        c.inc("saved_blocks", res.committed)
        c.inc("saved_bytes", res.committed * self._bb)
        c.inc("save_present_blocks", res.present)
        c.inc("save_dropped_blocks", res.not_admitted)   # the daemon's admission: a one-off
