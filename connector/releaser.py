"""Lease releases, off vLLM's hot path and never lost to a transient fault.

A lease pins its blocks in the daemon until released, and a live session
(heartbeats keep it alive) never gives them back by itself: a release that
is silently dropped leaks pinned capacity. So releases go to one background
thread that retries transport failures for up to `give_up_s`; a release the
daemon answers NOT_FOUND / FAILED_PRECONDITION is done (the lease is already
gone: released, or its session ended with a daemon restart).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Mapping, Optional, Sequence, Tuple

from kvkeeper.client import KVKeeperClientError

from .cpus import use_spare_cpus
from .link import DaemonLink, LinkDown, is_transport_failure

__all__ = ["Releaser"]

log = logging.getLogger("kvkeeper.connector")

_STOP = object()

# Each call goes out this long after it was queued. A release is queued when
# a step's output reports the load done (or the request ends): right then the
# engine core builds the step's output and its output thread sends the first
# token, and a Release sent at once (this thread, the client's, the daemon's
# reply) competes with both for the GIL and the cores. Measured on the ttft
# bench's 1-layer model, 2048-token full hits, 7 cold requests per engine
# side by side in one run: the output phase (first token built -> front
# end) had a median of 1.3 ms with releases sent at once, 0.99 ms with this
# delay, and 0.63 ms where a timer queued them 5 ms later (that wake-up is
# spared too, but a thread per release costs the scheduler its creation);
# the whole TTFT medians stayed within that machine's noise (22.5-24.8 ms).
# A lease held 5 ms longer pins nothing anyone waits for; calls keep their
# order (each waits the same delay from its own queueing).
DELAY_S = 0.005


class Releaser:
    def __init__(self, link: DaemonLink, give_up_s: float = 60.0, retry_s: float = 0.5,
                 delay_s: float = DELAY_S) -> None:
        self._link = link
        self._give_up_s = give_up_s
        self._retry_s = retry_s
        self._delay_s = delay_s
        self._q: "queue.Queue[object]" = queue.Queue()
        self._thread: Optional[threading.Thread] = None
        self._lock = threading.Lock()
        self._idle = threading.Event()
        self._idle.set()
        self._pending = 0
        self.released = 0
        self.failed = 0

    def release(self, lease_id: Optional[int], discard: bool = False,
                discard_indices: Sequence[int] = (),
                report: Optional[Mapping[str, int]] = None, last_turn: bool = False) -> None:
        """Queue Release(lease_id, discard, discard_indices, report, last_turn);
        returns at once. Without a lease, only a report is sent (a lookup that
        leased nothing)."""
        if not lease_id and report is None:
            return
        lid, indices = int(lease_id or 0), tuple(discard_indices)
        rep = None if report is None else dict(report)
        self._queue(lid, lambda c: c.release(lid, discard=discard, discard_indices=indices,
                                             report=rep, last_turn=last_turn))

    def narrow(self, lease_id: Optional[int], start: int, count: int) -> None:
        """Queue the narrowing of a lease to positions [start, start + count),
        ahead of any release queued after it."""
        if lease_id:
            lid = int(lease_id)
            self._queue(lid, lambda c: c.narrow(lid, start, count))

    def _queue(self, lease_id: int, call: Callable[[Any], Any]) -> None:
        with self._lock:
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=f"{self._link.name}-release",
                                                daemon=True)
                self._thread.start()
            self._pending += 1
            self._idle.clear()
        self._q.put((lease_id, call, time.monotonic()))

    def flush(self, timeout: float) -> bool:
        """Wait until every queued release is done; False on timeout."""
        return self._idle.wait(timeout)

    def close(self, timeout: float = 2.0) -> None:
        self.flush(timeout)
        with self._lock:
            if self._thread is not None:
                self._q.put(_STOP)

    def _done(self) -> None:
        with self._lock:
            self._pending -= 1
            if self._pending == 0:
                self._idle.set()

    def _run(self) -> None:
        use_spare_cpus()
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            lease_id, call, queued = item  # type: ignore[misc]
            try:
                wait = queued + self._delay_s - time.monotonic()
                if wait > 0:
                    time.sleep(wait)   # see DELAY_S
                self._release(lease_id, call, queued)
            finally:
                self._done()

    def _release(self, lease_id: int, call: Callable[[Any], Any], queued: float) -> None:
        while True:
            err: Optional[BaseException]
            try:
                self._link.call(call, "release")
                self.released += 1
                return
            except LinkDown as e:
                err = e
            except KVKeeperClientError as e:
                if not is_transport_failure(e):
                    log.debug("kvkeeper: lease %d already gone: %s", lease_id, e)
                    return
                err = e
            except Exception as e:  # noqa: BLE001 - keep the thread alive
                if not is_transport_failure(e):
                    log.warning("kvkeeper: releasing lease %d failed: %s", lease_id, e)
                    self.failed += 1
                    return
                err = e
            if time.monotonic() - queued > self._give_up_s:
                log.warning("kvkeeper: gave up releasing lease %d after %.0f s (%s); the daemon "
                            "frees it when this session ends", lease_id, self._give_up_s, err)
                self.failed += 1
                return
            time.sleep(self._retry_s)

    def stats(self) -> Tuple[int, int]:
        return self.released, self.failed
