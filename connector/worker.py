"""Worker-side logic: load leased blocks into the KV cache, copy new blocks out and save them.

Loads (start_load_kv, before the forward; the direct path: all layers at
once) match the LoadSpec's keys under this worker's own lease, copy the
blocks into a staging tensor (client.load_into, checksums verified), scatter
them into the paged KV tensors and release the lease. A block that is
missing, fails its checksum or cannot be read, and every block after it in
that load, is reported through get_block_ids_with_load_errors() so vLLM
recomputes it; a corrupt block is released with discard=True so the daemon
drops it.

Saves (wait_for_save, after the forward) copy the SaveSpecs' blocks out of
the KV cache into a staging tensor right away (the only step that touches
vLLM's memory) and hand them to a background thread that sends them
(client.save: reserve, write, commit with checksums). vLLM may therefore free
or reuse the blocks as soon as the step is over; request_finished never has
to delay a free. A bounded amount of staged bytes may wait; beyond it, and
while the daemon is unreachable, saves are dropped and counted.
"""
from __future__ import annotations

import logging
import queue
import threading
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from kvkeeper.client import ChecksumError, KVKeeperClientError, ResourceExhaustedError

from .blocks import BlockCodec, LayoutMismatch
from .config import ConnectorConfig
from .layout import KVLayout
from .link import DaemonLink, LinkDown
from .metadata import KVKeeperConnectorMetadata, KVKeeperWorkerMetadata, LoadSpec, SaveSpec
from .releaser import Releaser
from .stats import Counters, KVKeeperStats

__all__ = ["WorkerSide"]

log = logging.getLogger("kvkeeper.connector")

_STOP = object()


class _Saver:
    """One thread sending staged blocks; at most max_bytes staged at a time."""

    def __init__(self, link: DaemonLink, block_bytes: int, max_bytes: int,
                 counters: Counters) -> None:
        self._link = link
        self._bb = block_bytes
        self._max = max_bytes
        self._counters = counters
        self._q: "queue.Queue[object]" = queue.Queue()
        self._lock = threading.Lock()
        self._pending = 0
        self._idle = threading.Event()
        self._idle.set()
        self._thread: Optional[threading.Thread] = None

    def admit(self, nbytes: int) -> bool:
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

    def submit(self, keys: Sequence[bytes], rows: torch.Tensor) -> None:
        self._q.put((list(keys), rows))

    def cancel(self, nbytes: int) -> None:
        self._done(nbytes)

    def _done(self, nbytes: int) -> None:
        with self._lock:
            self._pending -= nbytes
            if self._pending <= 0:
                self._pending = 0
                self._idle.set()

    def flush(self, timeout: float) -> bool:
        return self._idle.wait(timeout)

    def close(self, timeout: float) -> None:
        self.flush(timeout)
        with self._lock:
            if self._thread is not None:
                self._q.put(_STOP)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is _STOP:
                return
            keys, rows = item  # type: ignore[misc]
            try:
                self._send(keys, rows)
            finally:
                self._done(rows.shape[0] * self._bb)

    def _send(self, keys: List[bytes], rows: torch.Tensor) -> None:
        c = self._counters
        n = len(keys)
        arr = rows.numpy()
        bufs = [arr[i] for i in range(n)]
        try:
            res = self._link.call(lambda cl: cl.save(keys, bufs), "save")
        except LinkDown:
            c.inc("save_dropped_blocks", n)
            return
        except ResourceExhaustedError as e:
            log.debug("kvkeeper: daemon full, %d block(s) not saved: %s", n, e)
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


class WorkerSide:
    """Everything the worker-role connector does for one TP rank."""

    def __init__(self, cfg: Optional[ConnectorConfig], layout: Optional[KVLayout], rank: int,
                 link: Optional[DaemonLink], counters: Optional[Counters] = None,
                 releaser: Optional[Releaser] = None) -> None:
        self.cfg = cfg
        self.layout = layout
        self.rank = rank
        self.link = link
        self.counters = counters or Counters()
        self.releaser = releaser if releaser is not None else (
            Releaser(link) if link is not None else None)
        self.codec: Optional[BlockCodec] = None
        self.disabled: Optional[str] = None
        self._disabled_reported = False
        self._invalid: Set[int] = set()
        self._loads_done: Dict[int, Dict[int, Tuple[int, bool]]] = {}
        self._saver: Optional[_Saver] = None

    # ---- set-up

    def disable(self, reason: str) -> None:
        if self.disabled is None:
            log.error("kvkeeper: connector disabled on TP rank %d: %s; vLLM recomputes "
                      "instead of loading", self.rank, reason)
            self.disabled = reason

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        if self.disabled is not None or self.layout is None or self.cfg is None:
            return
        try:
            self.codec = BlockCodec(self.layout, kv_caches, num_blocks)
        except LayoutMismatch as e:
            self.disable(f"the KV tensors do not match the layout derived from the config: {e}")
            return
        if self.link is not None:
            self._saver = _Saver(self.link, self.layout.block_bytes,
                                 self.cfg.max_pending_save_bytes, self.counters)
        log.info("kvkeeper: TP rank %d KV cache %s; namespace %s", self.rank,
                 self.codec.describe(), self.link.namespace if self.link else None)

    @property
    def usable(self) -> bool:
        return self.disabled is None and self.codec is not None and self.link is not None

    # ---- loads

    def start_load_kv(self, meta: Optional[KVKeeperConnectorMetadata]) -> None:
        if meta is None:
            return
        for spec in meta.loads:
            try:
                good, corrupt = self._load(spec) if self.usable else (0, False)
            except Exception as e:  # noqa: BLE001 - never into vLLM: recompute instead
                log.warning("kvkeeper: loading %d block(s) of %s failed: %s", spec.num_blocks(),
                            spec.req_id, e, exc_info=not isinstance(e, KVKeeperClientError))
                good, corrupt = 0, False
            self._finish_load(spec, good, corrupt)

    def fail_loads(self, meta: Any) -> None:
        """Report every block of every load as failed (the last resort when
        start_load_kv itself broke)."""
        for spec in getattr(meta, "loads", None) or ():
            self._finish_load(spec, 0, False)

    def _finish_load(self, spec: LoadSpec, good: int, corrupt: bool) -> None:
        n = spec.num_blocks()
        if good < n:
            self._invalid.update(spec.block_ids[good:])
            self.counters.inc("load_errors")
            self.counters.inc("load_error_blocks", n - good)
        if good and self.layout is not None:
            self.counters.inc("loaded_blocks", good)
            self.counters.inc("loaded_bytes", good * self.layout.block_bytes)
        self._loads_done.setdefault(spec.load_id, {})[self.rank] = (good, corrupt)

    def _load(self, spec: LoadSpec) -> Tuple[int, bool]:
        """Load spec's blocks; (leading blocks now in the KV cache, found corrupt)."""
        assert self.link is not None and self.codec is not None
        keys = list(spec.keys[self.rank]) if self.rank < len(spec.keys) else []
        n = spec.num_blocks()
        if not keys or len(keys) != n:
            return 0, False
        res = self.link.call(lambda c: c.match(keys, lease=True), "load")
        if not res.matched or not res.lease_id:
            return 0, False
        corrupt = False
        try:
            rows = self.codec.new_rows(res.matched)
            arr = rows.numpy()
            bufs = [arr[i] for i in range(res.matched)]
            good = min(res.matched, n)
            try:
                self.link.call(lambda c: c.load_into(res.lease_id, bufs), "load")
            except ChecksumError as e:
                corrupt = True
                self.counters.inc("checksum_errors", len(e.bad_indices))
                good = min([good] + list(e.bad_indices))
                log.warning("kvkeeper: %d block(s) of %s failed their checksum; they are dropped "
                            "from the daemon and recomputed", len(e.bad_indices), spec.req_id)
            try:
                self.codec.scatter(spec.block_ids[:good], rows[:good])
            except Exception:
                good = 0  # nothing written can be trusted; all of it is recomputed
                raise
        finally:
            if self.releaser is not None:
                self.releaser.release(res.lease_id, discard=corrupt)
        return good, corrupt

    def take_load_errors(self) -> Set[int]:
        out, self._invalid = self._invalid, set()
        return out

    def build_worker_meta(self) -> Optional[KVKeeperWorkerMetadata]:
        disabled: Dict[int, str] = {}
        if self.disabled and not self._disabled_reported:
            disabled[self.rank] = self.disabled
            self._disabled_reported = True
        if not self._loads_done and not disabled:
            return None
        done, self._loads_done = self._loads_done, {}
        return KVKeeperWorkerMetadata(loads_done=done, disabled=disabled)

    # ---- saves

    def wait_for_save(self, meta: Optional[KVKeeperConnectorMetadata]) -> None:
        if meta is None or not meta.saves:
            return
        if not self.usable or self._saver is None:
            return
        for spec in meta.saves:
            self._stage(spec)

    def _stage(self, spec: SaveSpec) -> None:
        assert self.codec is not None and self._saver is not None
        keys = spec.keys[self.rank] if self.rank < len(spec.keys) else ()
        n = spec.num_blocks()
        if not n or len(keys) != n:
            return
        nbytes = n * self.layout.block_bytes
        if not self._saver.admit(nbytes):
            self.counters.inc("save_dropped_blocks", n)
            return
        try:
            rows = self.codec.new_rows(n)
            self.codec.gather(spec.block_ids, rows)
        except Exception as e:  # noqa: BLE001
            self._saver.cancel(nbytes)
            log.warning("kvkeeper: copying %d block(s) of %s out of the KV cache failed: %s",
                        n, spec.req_id, e)
            self.counters.inc("save_errors")
            return
        self._saver.submit(keys, rows)

    def flush(self, timeout: float) -> bool:
        """Wait until staged saves and queued releases are sent (tests, shutdown)."""
        ok = True
        if self._saver is not None:
            ok = self._saver.flush(timeout) and ok
        if self.releaser is not None:
            ok = self.releaser.flush(timeout) and ok
        return ok

    def take_stats(self) -> Optional[KVKeeperStats]:
        return self.counters.take()

    def shutdown(self, timeout: float = 5.0) -> None:
        if self._saver is not None:
            self._saver.close(timeout)
        if self.releaser is not None:
            self.releaser.close(2.0)
        if self.link is not None:
            self.link.close()
