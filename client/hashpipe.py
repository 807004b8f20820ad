"""Checksums computed in a helper thread while the calling thread copies.

A fused copy (arena_format.copy_hashed) hashes each piece right after
copying it, on the same core: the copy waits on memory while the hash waits
on the core, one after the other. With a second core, HashPipe overlaps them:
the copying thread hands each piece it has copied to a helper thread, which
hashes it (still in the shared cache) while the next piece is copied. The
helper gets the pieces of one block after another, in order, so each block's
streaming checksum is the same value as the one-shot function. xxhash and
zlib drop the GIL while hashing, and the batch copies (arena_format.copy_run,
numpy ufuncs) drop it too, so the two threads run at once.

Helper threads come from one small pool per process, re-created after a fork
(a pool inherited through fork has no threads).
"""
from __future__ import annotations

import os
import queue
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Dict, Optional

from .checksum import Hasher

__all__ = ["HashPipe", "usable"]

# Two: a pipe per concurrent large load or save; a third waits for a helper.
_WORKERS = 2
_lock = threading.Lock()
_pool: Optional[ThreadPoolExecutor] = None


def _reset_after_fork() -> None:
    global _pool, _lock
    _pool, _lock = None, threading.Lock()


os.register_at_fork(after_in_child=_reset_after_fork)


def _executor() -> ThreadPoolExecutor:
    global _pool
    with _lock:
        if _pool is None:
            _pool = ThreadPoolExecutor(_WORKERS, thread_name_prefix="kvkeeper-hash")
        return _pool


def usable() -> bool:
    """Whether a helper thread can overlap anything: at least two CPUs are
    available to this process (one CPU would only interleave the two)."""
    try:
        return len(os.sched_getaffinity(0)) >= 2
    except (AttributeError, OSError):
        return (os.cpu_count() or 1) >= 2


_END = None


class HashPipe:
    """Per-block checksums of pieces handed over in order. `begin(i, algo)`
    starts block i; `feed(piece)` (the Update a copy calls) queues one of its
    pieces; `finish()` waits for the helper and returns {i: checksum}. Use
    one pipe from one thread; always call finish, also on errors."""

    __slots__ = ("_q", "_sums", "_future", "feed")

    def __init__(self) -> None:
        self._q: "queue.SimpleQueue[object]" = queue.SimpleQueue()
        self._sums: Dict[int, int] = {}
        self.feed = self._q.put   # bound once: called per piece
        self._future: Future = _executor().submit(self._run)

    def begin(self, index: int, algo: int) -> None:
        self._q.put((index, algo))

    def finish(self) -> Dict[int, int]:
        """Wait until every piece fed is hashed; the checksums by block index.
        Re-raises what the helper raised."""
        self._q.put(_END)
        self._future.result()
        return self._sums

    def _run(self) -> None:
        get, sums = self._q.get, self._sums
        index, h = -1, None
        try:
            while True:
                item = get()
                if type(item) is tuple:
                    if h is not None:
                        sums[index] = h.digest()
                    index, h = item[0], Hasher(item[1])
                elif item is _END:
                    break
                else:
                    h.feed(item)  # type: ignore[union-attr]  # begin() came first
        finally:
            # Drain what an error left, so that the feeding thread never blocks
            # (it cannot: SimpleQueue is unbounded) and views are dropped.
            while item is not _END:
                item = get()
        if h is not None:
            sums[index] = h.digest()
