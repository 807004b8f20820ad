"""Worker-side logic: load leased blocks into the KV cache, copy new blocks out and save them.

Loads (load/). Each LoadSpec of the step is fetched (load/fetch.py: the
blocks' place in the daemon's shared-memory arena, from the scheduler's
leased Match or one of this worker's own; or, without a mapped arena, the
lease streamed into the KV cache), then the blocks are copied straight from
the arena into the paged KV tensors, layer by layer, and each block's
checksum is computed over the bytes it was copied from, right after the
copy (load/copy_in.py says why there). Where that
work runs is the LoadStrategy chosen once, when the KV cache is registered
(load/strategy.py: beside the forward, halves, or inline).

A block that is missing, fails its checksum or cannot be read, and every
block after it in that load, is reported through
get_block_ids_with_load_errors() so vLLM recomputes it; a corrupt block is
dropped from the daemon (discarded when its lease is released: this
worker's own, or the scheduler's, which learns its index from the report).

Saves are asynchronous (save.py): wait_for_save only queues the step's
SaveSpecs for the save thread. Until a block is copied out vLLM must not
reuse it, so a request that saved returns True from request_finished (its
blocks are kept), and the next step's metadata names it: get_finished
copies out whatever the thread has not reached yet and answers it, and vLLM
frees the blocks then. A preempted request's blocks are copied out in
handle_preemptions, before the forward that may rewrite them.

load_timings is the worker's observation point: the phases of the last step
that loaded (load/timings.py), for benchmarks and debugging; nothing here
reads it back.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Dict, List, Mapping, Optional, Set

import torch

from .blocks import BlockCodec, LayoutMismatch
from .config import ConnectorConfig
from .cpus import spare_cpus
from .gpu import cuda_load_strategy, on_cuda
from .io_thread import IoThread
from .layout import KVLayout
from .link import DaemonLink
from .load.choice import choose_load_strategy
from .load.copy_in import BlockLoader
from .load.fetch import Fetcher
from .load.step import LoadResults, StepLoads
from .load.strategy import LoadStrategy
from .load.timings import LoadTimings
from .metadata import KVKeeperConnectorMetadata, KVKeeperWorkerMetadata, SaveSpec
from .peer.worker import WorkerPeer
from .releaser import Releaser
from .save import SaveJob, SaveThread
from .stats import Counters, KVKeeperStats

__all__ = ["WorkerSide"]

log = logging.getLogger("kvkeeper.connector")
# The most an abandoned step waits for its running copy job to stop (it stops
# at its next layer or load: milliseconds; only a stuck one takes longer).
STOP_WAIT_S = 60.0


class WorkerSide:
    """Everything the worker-role connector does for one TP rank."""

    def __init__(self, cfg: Optional[ConnectorConfig], layout: Optional[KVLayout], rank: int,
                 link: Optional[DaemonLink], counters: Optional[Counters] = None,
                 releaser: Optional[Releaser] = None, engine: str = "") -> None:
        self.cfg = cfg
        self.engine = engine   # vLLM's engine id: names its peer generations
        self.layout = layout
        self.rank = rank
        self.tp_size = int((link.namespace if link else {}).get("tp_size", 1))
        self.link = link
        self.counters = counters or Counters()
        self.releaser = releaser if releaser is not None else (
            Releaser(link) if link is not None else None)
        self.codec: Optional[BlockCodec] = None
        self.disabled: Optional[str] = None
        self._disabled_reported = False
        self._results = LoadResults(rank, layout.block_bytes if layout is not None else None,
                                    self.counters)
        self._io = IoThread(cfg)
        self._saver: Optional[SaveThread] = None
        self._save_jobs: Dict[str, List[SaveJob]] = {}   # by request: queued saves
        self._fetcher: Optional[Fetcher] = None
        self._step: Optional[StepLoads] = None
        # Where loads are copied and checked; chosen in register_kv_caches.
        self.load_strategy: Optional[LoadStrategy] = None
        # The phases of the last step that loaded, for whoever observes the
        # worker (benchmarks); replaced at each start_load_kv, never read here.
        self.load_timings = LoadTimings()
        self.peer: Optional[WorkerPeer] = None   # kvkeeper_peer: same-host peers (peer/)

    # ---- set-up

    def disable(self, reason: str) -> None:
        if self.disabled is None:
            log.error("kvkeeper: connector disabled on TP rank %d: %s; vLLM recomputes "
                      "instead of loading", self.rank, reason)
            self.disabled = reason

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor], num_blocks: int) -> None:
        if self.disabled is not None or self.layout is None or self.cfg is None:
            return
        # Before the codec reads the tensors' addresses: peers need the cache in shared memory.
        shared = WorkerPeer.prepare(self.cfg, kv_caches, self.layout.layer_names, self.tp_size)
        try:
            self.codec = BlockCodec(self.layout, kv_caches, num_blocks)
        except LayoutMismatch as e:
            self.disable(f"the KV tensors do not match the layout derived from the config: {e}")
            return
        loader = BlockLoader(self.codec, self.cfg.checksum != "none", self.counters,
                             self.releaser)
        strategy = choose_load_strategy(self.cfg.load_overlap, len(spare_cpus()))
        # KV cache on CUDA: gpu/ (pinned arena, side-stream copies); else the CPU strategy.
        self.load_strategy = (cuda_load_strategy(loader, self._io, self.link)
                              or strategy(loader, self._io))
        if self.link is not None:
            # A CPU engine's forward owns its cores: saves copy with one thread
            # per spare core (one where there is none); a CUDA worker's host
            # cores are the client's to use (auto).
            self.link.copy_threads = 0 if on_cuda(self.codec) else max(1, len(spare_cpus()))
            # Connect from the I/O thread, so that the client's threads run where it does.
            ready = self._io.submit(self._connect)
            self._saver = SaveThread(self.link, self.codec, self.cfg.max_pending_save_bytes,
                                     self.counters, ready,
                                     waits_for_word=self.tp_size > 1)   # see _own_outcomes
            self._fetcher = Fetcher(self.link, self.rank, loader, self._results, self.releaser)
            if shared is not None:
                self._start_peer(shared, num_blocks)
        log.info("kvkeeper: TP rank %d KV cache %s; namespace %s; loads %s", self.rank,
                 self.codec.describe(), self.link.namespace if self.link else None,
                 self.load_strategy.name)

    def _start_peer(self, shared: Any, num_blocks: int) -> None:
        assert self.cfg is not None and self.link is not None and self.codec is not None
        try:
            self.peer = WorkerPeer(self.cfg, self.link, self._io, self.engine, shared, self.codec,
                                   num_blocks, self.counters, self._results.finish)
        except Exception as e:  # noqa: BLE001 - peers are an extra: run without them
            log.warning("kvkeeper: same-host peers are off for this worker: %s", e)
            shared.close()
            return
        if self._fetcher is not None:
            self._fetcher.peer = self.peer.source.load

    def _connect(self) -> None:
        assert self.link is not None
        try:
            self.link.call(lambda c: None, "connect")
        except Exception as e:  # noqa: BLE001 - the link retries on its next use
            log.debug("kvkeeper: first connection failed: %s", e)

    @property
    def usable(self) -> bool:
        return self.disabled is None and self.codec is not None and self.link is not None

    # ---- loads

    def start_load_kv(self, meta: Optional[KVKeeperConnectorMetadata]) -> None:
        self._settle()
        if meta is None or not meta.loads:
            return
        loads = list(meta.loads)
        strategy, fetcher = self.load_strategy, self._fetcher
        if not self.usable or strategy is None or fetcher is None:
            for spec in loads:
                self._results.finish(spec, 0)
            return
        timings = self.load_timings = LoadTimings()
        t0 = time.perf_counter()
        try:
            fetched = strategy.fetch(lambda: fetcher.fetch_all(loads, timings))
        except BaseException as e:
            log.warning("kvkeeper: fetching %d load(s) failed: %s", len(loads), e)
            for spec in loads:
                self._results.finish(spec, 0)
            if not isinstance(e, Exception):
                raise
            return
        timings.fetch = time.perf_counter() - t0
        if not fetched:
            return
        step = StepLoads(fetched, strategy.paced_layers(), timings)
        self._step = step
        strategy.start(step)
        if not strategy.beside_forward:
            self._settle()

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._step
        if step is None:
            return
        ev = step.layer_done.get(layer_name)
        if ev is None or ev.is_set():
            return
        t = time.perf_counter()
        if not ev.wait(self._io.wait_s):
            # Never expected (the copy is local memory); if it happens the
            # layer's attention reads blocks still being written: fail them all.
            step.abandoned = True
            log.error("kvkeeper: layer %s was not loaded in time; its blocks are recomputed",
                      layer_name)
        step.timings.add("layer_wait", time.perf_counter() - t)

    def _settle(self) -> None:
        """Finish this step's direct loads: wait for their copies and checks and
        report each one (vLLM reads the errors right after the forward)."""
        step, self._step = self._step, None
        if step is None:
            return
        if step.future is not None:
            t = time.perf_counter()
            try:
                step.future.result(timeout=self._io.wait_s)
            except BaseException as e:  # noqa: BLE001 - timeout or a bug: recompute all
                step.abandoned = True
                log.error("kvkeeper: loading blocks did not finish cleanly (%s); they are "
                          "recomputed", e or type(e).__name__)
                self._stop(step)
            step.timings.check_wait = time.perf_counter() - t
        for f in step.fetched:
            good = 0 if step.abandoned else f.good
            self._results.finish(f.spec, good, f.bad)
            if self.peer is not None:
                self.peer.note_load(f.spec, good)

    def _stop(self, step: StepLoads) -> None:
        """An abandoned step's copy job must not write into the KV cache once its
        blocks are reported failed (vLLM recomputes them, and the scheduler's
        lease, which kept their arena pages, goes): a job not started never
        runs (its views and leases released here); a running one stops at its
        next layer or load (copy_in.py) and is waited for."""
        fut = step.future
        if fut is None:
            return
        if fut.cancel():
            self.load_strategy.loader.release(step)   # type: ignore[union-attr]
            return
        try:
            fut.result(timeout=STOP_WAIT_S)
        except BaseException as e:  # noqa: BLE001 - it ended, one way or another
            if not fut.done():
                log.error("kvkeeper: an abandoned load copy is still running after %.0f s (%s)",
                          STOP_WAIT_S, e or type(e).__name__)

    def settle(self) -> None:
        """Finish this step's loads now (connector/groups.py reports them itself)."""
        self._settle()

    def take_results(self) -> Dict[int, Dict[int, Any]]:
        """Each finished load's (good, corrupt) on this rank since the last call,
        without reporting block ids to vLLM (connector/groups.py: vLLM takes no
        per-block failures with several KV cache groups)."""
        self._settle()
        self._results.take_invalid()
        return self._results.take_done()

    def fail_loads(self, meta: Any) -> None:
        """Report every block of every load as failed (the last resort when
        start_load_kv itself broke), and hand back what the step held: a copy
        job that started stops and releases by itself (_stop); one that never
        started leaves its leases to us (else pinned for the session's life)."""
        step, self._step = self._step, None
        if step is not None:
            step.abandoned = True
            self._stop(step)
            if (step.future is None or step.future.done()) and self.load_strategy is not None:
                self.load_strategy.loader.release(step)
        for spec in getattr(meta, "loads", None) or ():
            self._results.finish(spec, 0)

    def take_load_errors(self) -> Set[int]:
        self._settle()
        return self._results.take_invalid()

    def build_worker_meta(self) -> Optional[KVKeeperWorkerMetadata]:
        self._settle()
        disabled: Dict[int, str] = {}
        if self.disabled and not self._disabled_reported:
            disabled[self.rank] = self.disabled
            self._disabled_reported = True
        done = self._results.take_done()
        if not done and not disabled:
            return None
        return KVKeeperWorkerMetadata(loads_done=done, disabled=disabled)

    # ---- saves

    def wait_for_save(self, meta: Optional[KVKeeperConnectorMetadata]) -> None:
        """Queue this step's saves; the save thread copies them out of the KV
        cache. vLLM keeps their blocks until copy_out_for() says they are out."""
        if meta is not None and self._saver is not None:
            self._saver.outcomes({**self._own_outcomes(), **meta.load_outcomes})
        if meta is None or not meta.saves:
            return
        if self.peer is not None:
            # Blocks computed over a load not known clean are no one's to copy:
            # they may be wrong KV until vLLM recomputes them in place.
            saver = self._saver
            self.peer.note_saves([s for s in meta.saves if not s.after_loads or (
                saver is not None and saver.known_clean(s.after_loads))])
        # Jobs copied out already no longer pin anything: forget them.
        for rid in [r for r, jobs in self._save_jobs.items() if all(j.copied for j in jobs)]:
            del self._save_jobs[rid]
        if not self.usable or self._saver is None:
            return
        for spec in meta.saves:
            self._queue_save(spec)

    def _own_outcomes(self) -> Dict[int, bool]:
        """With one rank, its loads' outcomes are this worker's own (this step's
        and earlier ones'): saves computed over them need not wait for the
        scheduler's word, which comes only with a later step (vLLM may not
        step again before another request arrives). With several ranks, one
        rank's failed load corrupts what every rank computes: the scheduler's
        word, which sees them all, rules."""
        self._settle()   # this step's loads have ended (as before vLLM reads the errors)
        own = self._results.take_clean()
        return own if self.tp_size == 1 else {}

    def _queue_save(self, spec: SaveSpec) -> None:
        assert self.codec is not None and self._saver is not None and self.layout is not None
        keys = spec.keys[self.rank] if self.rank < len(spec.keys) else ()
        n = spec.num_blocks()
        if not n or len(keys) != n:
            return
        if not self._saver.admit(n * self.layout.block_bytes):
            self.counters.inc("save_dropped_blocks", n)
            return
        parent = spec.parents[self.rank] if self.rank < len(spec.parents) else None
        job = SaveJob(spec.req_id, keys, spec.block_ids, parent, spec.after_loads)
        self._save_jobs.setdefault(spec.req_id, []).append(job)
        self._saver.submit(job)

    def copy_out_for(self, req_ids: Set[str]) -> None:
        """Return once no queued save of req_ids still reads their blocks in
        the KV cache (copying what the save thread has not reached yet here):
        vLLM is about to free or rewrite them."""
        if not req_ids or self.codec is None:
            return
        t = time.perf_counter()
        for rid in req_ids:
            for job in self._save_jobs.pop(rid, ()):
                job.copy_out(self.codec, self.counters)
        self.load_timings.copy_out_wait = time.perf_counter() - t

    def copy_out_all(self) -> None:
        """copy_out_for every request with queued saves (a sliding-window group:
        vLLM frees its blocks outside the window while the request runs)."""
        self.copy_out_for(set(self._save_jobs))

    def saves_pinning(self) -> int:
        """Queued saves whose blocks are not copied out yet (tests)."""
        return sum(1 for jobs in self._save_jobs.values() for j in jobs if not j.copied)

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

    def shutdown(self, timeout: float = 1.0) -> None:
        try:
            self._settle()
            self.copy_out_for(set(self._save_jobs))
        except Exception as e:  # noqa: BLE001
            log.debug("kvkeeper: settling loads at shutdown failed: %s", e)
        self._io.shutdown()
        getattr(self.load_strategy, "close", lambda: None)()   # gpu/: unpin the arena
        if self.peer is not None:
            self.peer.close()
        if self._saver is not None:
            self._saver.close(timeout)
        if self.releaser is not None:
            self.releaser.close(0.5)   # closing the session frees whatever is left
        if self.link is not None:
            self.link.close()
