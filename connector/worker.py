"""Worker-side logic: load leased blocks into the KV cache, copy new blocks out and save them.

Loads. The scheduler's leased Match returned where the blocks lie in the
daemon's shared-memory arena (LoadSpec.refs); where this worker maps the
same arena it needs no RPC, else start_load_kv matches the keys under its
own lease, in one round trip that returns the same (Match, blocks=True).
The blocks are copied straight from the arena into the paged KV tensors,
layer by layer, and each block's checksum is computed over the bytes that
landed in the KV cache. Where that work runs (kvkeeper_load_overlap, see
cpus.py for the spare cores vLLM's CPU backend leaves to the rest of the
engine): with two or more spare cores, on a connector thread there, beside
the forward: wait_for_layer_load(l) waits only for layer l, so attention on
the first layers runs while later ones are copied, and the checksums are
checked while the forward runs; with one (the engine core busy-polls it)
before the forward, that thread doing half of it; with none, before the
forward in vLLM's thread. vLLM takes the load errors after the forward
(get_block_ids_with_load_errors) and drops that step's output for a request
whose blocks failed, so a block checked after its attention ran is still
never served: it is recomputed. The block the forward itself writes into
(the prompt's last token) is always checked before the forward.
Without a mapped arena (another host, or kvkeeper_transport=stream) blocks
are streamed, each copied into the KV cache and checked there as it arrives
(stream_load.py), before the forward.

A block that is missing, fails its checksum or cannot be read, and every
block after it in that load, is reported through
get_block_ids_with_load_errors() so vLLM recomputes it; a corrupt block is
dropped from the daemon (discarded when its lease is released: this
worker's own, or the scheduler's, which learns its index from the report).

Saves are asynchronous. wait_for_save (after the forward) only queues the
step's SaveSpecs; a connector thread copies their blocks out of the KV cache
into a staging tensor and sends them (client.save: reserve, write, commit
with checksums). Until a block is copied out vLLM must not reuse it, so a
request that saved returns True from request_finished (its blocks are kept),
and the next step's metadata names it: get_finished copies out whatever the
thread has not reached yet and answers it, and vLLM frees the blocks then.
A preempted request's blocks are copied out in handle_preemptions, before
the forward that may rewrite them. A bounded amount of queued bytes may
wait; beyond it, and while the daemon is unreachable, saves are dropped and
counted (a lost save is only a future miss).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Dict, List, Mapping, Optional, Sequence, Set, Tuple

import torch

from kvkeeper.client import KVKeeperClientError, ResourceExhaustedError
from kvkeeper.client.checksum import ALGOS
from kvkeeper.v1 import kvkeeper_pb2 as pb

from .blocks import BlockCodec, LayoutMismatch, block_source
from .config import ConnectorConfig
from .cpus import spare_cpus, use_spare_cpus
from .layout import KVLayout
from .link import DaemonLink, LinkDown
from .metadata import KVKeeperConnectorMetadata, KVKeeperWorkerMetadata, LoadSpec, SaveSpec
from .releaser import Releaser
from .stats import Counters, KVKeeperStats
from .stream_load import load_streamed

__all__ = ["WorkerSide"]

log = logging.getLogger("kvkeeper.connector")

_STOP = object()


class _SaveJob:
    """One SaveSpec on this rank: copied out of the KV cache exactly once, by
    the save thread or, when vLLM is about to reuse the blocks, by whoever
    needs it done first."""

    __slots__ = ("req_id", "keys", "block_ids", "rows", "copied", "_lock")

    def __init__(self, req_id: str, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        self.req_id = req_id
        self.keys = list(keys)
        self.block_ids = tuple(block_ids)
        self.rows: Optional[torch.Tensor] = None
        self.copied = False
        self._lock = threading.Lock()

    @property
    def num_blocks(self) -> int:
        return len(self.block_ids)

    def copy_out(self, codec: BlockCodec, counters: Counters) -> None:
        with self._lock:
            if self.copied:
                return
            try:
                rows = codec.new_rows(len(self.block_ids))
                codec.gather(self.block_ids, rows)
                self.rows = rows
            except Exception as e:  # noqa: BLE001 - a lost save is a future miss
                log.warning("kvkeeper: copying %d block(s) of %s out of the KV cache failed: %s",
                            len(self.block_ids), self.req_id, e)
                counters.inc("save_errors")
            finally:
                self.copied = True


class _Saver:
    """One thread copying queued blocks out of the KV cache and sending them;
    at most max_bytes queued at a time."""

    def __init__(self, link: DaemonLink, codec: BlockCodec, max_bytes: int,
                 counters: Counters, ready: "Optional[Future[None]]" = None) -> None:
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

    def submit(self, job: _SaveJob) -> None:
        self._q.put(job)

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
            assert isinstance(job, _SaveJob)
            try:
                job.copy_out(self._codec, self._counters)
                rows, job.rows = job.rows, None
                if rows is not None:
                    self._send(job.keys, rows)
            except Exception as e:  # noqa: BLE001 - keep the thread alive
                log.warning("kvkeeper: saving blocks of %s failed: %s", job.req_id, e)
            finally:
                self._done(job.num_blocks * self._bb)

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


class _Fetched:
    """One LoadSpec after its Match: a lease and views of its blocks in the arena."""

    __slots__ = ("spec", "lease_id", "n", "copy_n", "sources", "sums", "checked", "good", "bad")

    def __init__(self, spec: LoadSpec, lease_id: Optional[int], n: int,
                 sources: List[torch.Tensor], sums: List[Tuple[int, int]]) -> None:
        self.spec = spec
        self.lease_id = lease_id
        self.n = n                      # blocks to copy in: the leading matched ones
        self.copy_n = n                 # of those, copied by the step's copy job
        self.checked: Dict[int, bool] = {}   # blocks copied and checked already
        self.sources: Optional[List[torch.Tensor]] = sources
        self.sums = sums                # (algo, checksum) per block, as committed
        self.good = 0                   # leading blocks copied in and checked
        self.bad: List[int] = []        # lease positions that failed their checksum


class _StepLoads:
    """The direct loads of one step: per-layer "copied" events and the job."""

    def __init__(self, fetched: List[_Fetched], layer_names: Sequence[str]) -> None:
        self.fetched = fetched
        self.layer_done = {name: threading.Event() for name in layer_names}
        self.future: Optional["Future[None]"] = None
        self.abandoned = False          # give up on every block (a timeout, a failed copy)


class WorkerSide:
    """Everything the worker-role connector does for one TP rank."""

    halves_min_blocks = 8   # below, handing half to the I/O thread costs more than it saves

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
        self._io_pool: Optional[ThreadPoolExecutor] = None
        self._save_jobs: Dict[str, List[_SaveJob]] = {}   # by request: queued saves
        self._step: Optional[_StepLoads] = None
        self._overlap = False   # copies and checks run on a spare core, beside the forward
        self._helper = False    # the I/O thread takes half of them, before the forward
        self.timings: Dict[str, float] = {}   # the last loads' phases (benchmarks read it)

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
        spare = len(spare_cpus())
        mode = self.cfg.load_overlap
        self._overlap = spare >= 1 if mode == "on" else (mode == "auto" and spare >= 2)
        self._helper = mode == "auto" and spare == 1   # halves the copy before the forward
        if self.link is not None:
            # Connect from the I/O thread, so that the client's threads run where it does.
            ready = self._io().submit(self._connect)
            self._saver = _Saver(self.link, self.codec, self.cfg.max_pending_save_bytes,
                                 self.counters, ready)
        log.info("kvkeeper: TP rank %d KV cache %s; namespace %s", self.rank,
                 self.codec.describe(), self.link.namespace if self.link else None)

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

    def _io(self) -> ThreadPoolExecutor:
        """The thread that makes this worker's RPCs and, with a spare core, its
        copies and checks. Threads it starts (the gRPC client's loop) inherit
        its CPUs."""
        if self._io_pool is None:
            self._io_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvkeeper-io",
                                               initializer=use_spare_cpus)
        return self._io_pool

    def start_load_kv(self, meta: Optional[KVKeeperConnectorMetadata]) -> None:
        self._settle()
        if meta is None or not meta.loads:
            return
        loads = list(meta.loads)
        if not self.usable:
            for spec in loads:
                self._finish_load(spec, 0)
            return
        self.timings = {}
        t0 = time.perf_counter()
        fut: "Optional[Future[List[_Fetched]]]" = None
        try:
            if self._overlap:
                fut = self._io().submit(self._fetch_all, loads)
                fetched = fut.result(timeout=self._io_wait_s())
            else:   # nothing to gain from the hop: the RPC is waited for anyway
                fetched = self._fetch_all(loads)
        except BaseException as e:
            if fut is not None:
                fut.cancel()
            log.warning("kvkeeper: fetching %d load(s) failed: %s", len(loads), e)
            for spec in loads:
                self._finish_load(spec, 0)
            if not isinstance(e, Exception):
                raise
            return
        self.timings["fetch"] = time.perf_counter() - t0
        if not fetched:
            return
        step = _StepLoads(fetched, self.codec.layer_names if self._overlap else ())
        self._step = step
        if self._overlap:
            step.future = self._io().submit(self._copy_and_check, step)
        elif self._helper and sum(f.copy_n for f in fetched) >= self.halves_min_blocks:
            self._copy_and_check_halves(step)
            self._settle()
        else:
            self._copy_and_check(step)
            self._settle()

    def wait_for_layer_load(self, layer_name: str) -> None:
        step = self._step
        if step is None:
            return
        ev = step.layer_done.get(layer_name)
        if ev is None or ev.is_set():
            return
        t = time.perf_counter()
        if not ev.wait(self._io_wait_s()):
            # Never expected (the copy is local memory); if it happens the
            # layer's attention reads blocks still being written: fail them all.
            step.abandoned = True
            log.error("kvkeeper: layer %s was not loaded in time; its blocks are recomputed",
                      layer_name)
        self.timings["layer_wait"] = self.timings.get("layer_wait", 0.0) + time.perf_counter() - t

    def _settle(self) -> None:
        """Finish this step's direct loads: wait for their copies and checks and
        report each one (vLLM reads the errors right after the forward)."""
        step, self._step = self._step, None
        if step is None:
            return
        if step.future is not None:
            t = time.perf_counter()
            try:
                step.future.result(timeout=self._io_wait_s())
            except BaseException as e:  # noqa: BLE001 - timeout or a bug: recompute all
                step.abandoned = True
                log.error("kvkeeper: loading blocks did not finish cleanly (%s); they are "
                          "recomputed", e or type(e).__name__)
            self.timings["check_wait"] = time.perf_counter() - t
        for f in step.fetched:
            good = 0 if step.abandoned else f.good
            self._finish_load(f.spec, good, f.bad)

    def _io_wait_s(self) -> float:
        cfg = self.cfg
        return (cfg.io_timeout_s * (cfg.max_retries + 1) + 1.0) if cfg is not None else 10.0

    def fail_loads(self, meta: Any) -> None:
        """Report every block of every load as failed (the last resort when
        start_load_kv itself broke)."""
        step, self._step = self._step, None
        if step is not None:
            step.abandoned = True
        for spec in getattr(meta, "loads", None) or ():
            self._finish_load(spec, 0)

    def _finish_load(self, spec: LoadSpec, good: int, bad: Sequence[int] = ()) -> None:
        n = spec.num_blocks()
        if good < n:
            self._invalid.update(spec.block_ids[good:])
            self.counters.inc("load_errors")
            self.counters.inc("load_error_blocks", n - good)
        if good and self.layout is not None:
            self.counters.inc("loaded_blocks", good)
            self.counters.inc("loaded_bytes", good * self.layout.block_bytes)
        self._loads_done.setdefault(spec.load_id, {})[self.rank] = (good, tuple(bad))

    # -- on the I/O thread

    def _fetch_all(self, loads: Sequence[LoadSpec]) -> List["_Fetched"]:
        """Match every load under a lease; the ones that can be copied from the
        arena come back, the others are done (streamed, or failed) here."""
        out: List[_Fetched] = []
        for spec in loads:
            try:
                f = self._fetch(spec)
            except Exception as e:  # noqa: BLE001 - never into vLLM: recompute instead
                log.warning("kvkeeper: loading %d block(s) of %s failed: %s", spec.num_blocks(),
                            spec.req_id, e, exc_info=not isinstance(e, KVKeeperClientError))
                self._finish_load(spec, 0)
                continue
            if f is not None:
                out.append(f)
        return out

    def _fetch(self, spec: LoadSpec) -> Optional["_Fetched"]:
        assert self.link is not None and self.codec is not None
        keys = list(spec.keys[self.rank]) if self.rank < len(spec.keys) else []
        n = spec.num_blocks()
        if not keys or len(keys) != n:
            self._finish_load(spec, 0)
            return None
        f = self._fetch_by_refs(spec)
        if f is not None:
            return f
        # report_use: the scheduler reports this load with its own lookup.
        res = self.link.call(lambda c: c.match(keys, lease=True, blocks=True, report_use=True),
                             "load")
        if not res.matched or not res.lease_id:
            self._finish_load(spec, 0)
            return None
        m = min(res.matched, n)
        streamed = False   # _load_streamed releases the lease itself
        try:
            views = None
            if len(res.blocks) >= m:
                views = self.link.call(lambda c: c.arena_views(res.blocks[:m]), "load")
            if views is None:
                streamed = True
                good, bad = self._load_streamed(spec, res.lease_id, m)
                self._finish_load(spec, good, bad)
                return None
            return self._fetched(spec, res.lease_id, res.blocks[:m], views)
        except BaseException:
            if not streamed and self.releaser is not None:
                self.releaser.release(res.lease_id)
            raise

    def _fetch_by_refs(self, spec: LoadSpec) -> Optional["_Fetched"]:
        """The load without an RPC: the scheduler's leased Match said where the
        blocks lie, and its lease keeps them there until this load is
        reported. None when that cannot be used here (no refs, another arena)."""
        refs = spec.refs[self.rank] if self.rank < len(spec.refs) else ()
        arena = spec.arena_ids[self.rank] if self.rank < len(spec.arena_ids) else None
        if not refs or len(refs) != spec.num_blocks() or arena is None:
            return None
        assert self.link is not None

        def views(c: Any) -> Optional[List[List[memoryview]]]:
            return c.arena_views(refs) if c.arena_id == arena else None

        v = self.link.call(views, "load")
        return self._fetched(spec, None, refs, v) if v is not None else None

    def _fetched(self, spec: LoadSpec, lease_id: Optional[int], refs: Sequence[Any],
                 views: List[List[memoryview]]) -> "_Fetched":
        """A load ready to copy: its blocks' arena views, and the last block
        already copied and checked if the forward writes into it."""
        assert self.codec is not None
        m = len(refs)
        sources = [block_source(v, self.codec.block_bytes) for v in views]
        sums = [(b.checksum_algo, b.checksum) for b in refs]
        f = _Fetched(spec, lease_id, m, sources, sums)
        if spec.recomputes_last and m == spec.num_blocks():
            # The forward writes the prompt's last token into this block, and
            # its recomputed KV may differ from the stored one in the last
            # bits: copy and check the block before the forward, not beside it.
            last = m - 1
            self._copy_in(f, last, m)
            f.checked[last] = self._block_ok(spec.block_ids[last], sums[last])
            f.copy_n = last
        return f

    def _copy_in(self, f: "_Fetched", lo: int, hi: int) -> None:
        """Copy blocks lo..hi-1 of f, every layer, from the arena into the KV cache."""
        assert self.codec is not None and f.sources is not None
        for i in range(self.codec.num_layers):
            self.codec.copy_layer_in(i, f.spec.block_ids[lo:hi], f.sources[lo:hi])

    def _release_fetched(self, step: "_StepLoads") -> None:
        """Drop the arena views, then release each load's lease, discarding its
        corrupt blocks (a load by the scheduler's refs has no lease here)."""
        for f in step.fetched:
            f.sources = None
            if self.releaser is not None:
                self.releaser.release(f.lease_id, discard_indices=f.bad)

    def _copy_and_check(self, step: "_StepLoads") -> None:
        """Copy every fetched block in, layer by layer, then check them."""
        codec = self.codec
        assert codec is not None
        t0 = time.perf_counter()
        try:
            for i, name in enumerate(codec.layer_names):
                for f in step.fetched:
                    if f.sources and f.copy_n:
                        codec.copy_layer_in(i, f.spec.block_ids[:f.copy_n],
                                            f.sources[:f.copy_n])
                ev = step.layer_done.get(name)
                if ev is not None:
                    ev.set()
        except Exception as e:  # noqa: BLE001
            log.warning("kvkeeper: copying loaded blocks into the KV cache failed: %s", e,
                        exc_info=True)
            step.abandoned = True
        finally:
            for ev in step.layer_done.values():
                ev.set()
        t1 = time.perf_counter()
        self.timings["copy"] = t1 - t0
        for f in step.fetched:
            if not step.abandoned:
                try:
                    self._check(f)
                except Exception as e:  # noqa: BLE001
                    log.warning("kvkeeper: checking loaded blocks of %s failed: %s",
                                f.spec.req_id, e, exc_info=True)
                    f.good = 0
        self._release_fetched(step)
        self.timings["check"] = time.perf_counter() - t1

    def _copy_and_check_halves(self, step: "_StepLoads") -> None:
        """Before the forward, with the I/O thread (on a spare core) copying and
        checking the second half of every load while this thread does the
        first: copies and CRC32 run without the GIL, so the two overlap."""
        t0 = time.perf_counter()
        mine: List[Tuple[_Fetched, int, int]] = []
        theirs: List[Tuple[_Fetched, int, int]] = []
        for f in step.fetched:
            half = f.copy_n // 2
            mine.append((f, 0, half))
            theirs.append((f, half, f.copy_n))

        def work(parts: List[Tuple[_Fetched, int, int]]) -> List[List[int]]:
            out = []
            for f, lo, hi in parts:
                if lo < hi and f.sources:
                    self._copy_in(f, lo, hi)
                out.append(self._bad_in(f, lo, hi))
            return out

        bad: Optional[List[List[int]]] = None
        fut = self._io().submit(work, theirs)
        try:
            first = work(mine)
            second = fut.result(timeout=self._io_wait_s())
            bad = [a + b for a, b in zip(first, second)]
        except BaseException as e:  # noqa: BLE001 - a failed copy: recompute all of it
            log.warning("kvkeeper: copying loaded blocks into the KV cache failed: %s", e,
                        exc_info=True)
            step.abandoned = True
            try:   # never leave the helper writing into the KV cache
                fut.result(timeout=self._io_wait_s())
            except BaseException:  # noqa: BLE001
                pass
        if bad is not None:
            for f, b in zip(step.fetched, bad):
                self._set_bad(f, b + self._bad_in(f, f.copy_n, f.n))
        self._release_fetched(step)
        self.timings["copy"] = self.timings["check"] = time.perf_counter() - t0

    def _bad_in(self, f: "_Fetched", lo: int, hi: int) -> List[int]:
        """Blocks lo..hi-1 of f that fail their checksum as they are in the KV cache."""
        return [i for i in range(lo, hi)
                if not f.checked.get(i, True) or
                (i not in f.checked and not self._block_ok(f.spec.block_ids[i], f.sums[i]))]

    def _check(self, f: "_Fetched") -> None:
        """Checksum the blocks as they are in the KV cache; f.good = leading good ones."""
        self._set_bad(f, self._bad_in(f, 0, f.n))

    def _set_bad(self, f: "_Fetched", bad: List[int]) -> None:
        f.bad = bad
        f.good = bad[0] if bad else f.n
        if bad:
            self.counters.inc("checksum_errors", len(bad))
            log.warning("kvkeeper: %d block(s) of %s failed their checksum; they are dropped "
                        "from the daemon and recomputed", len(bad), f.spec.req_id)

    def _block_ok(self, block_id: int, expected: Tuple[int, int]) -> bool:
        """Whether vLLM block `block_id` matches the checksum it was committed with."""
        assert self.codec is not None
        algo, want = expected
        fn = ALGOS.get(algo)
        if fn is None or self.cfg is None or self.cfg.checksum == "none":
            return True   # stored without a checksum (or one this process lacks), or off
        return self.codec.block_checksum(block_id, fn, algo == pb.CHECKSUM_CRC32) == want

    def _load_streamed(self, spec: LoadSpec, lease_id: int, n: int) -> Tuple[int, List[int]]:
        """Stream the lease's first n blocks into the KV cache, each checked
        there as it arrives; (leading blocks loaded, positions found corrupt)."""
        assert self.link is not None and self.codec is not None
        codec = self.codec
        bad: List[int] = []
        try:
            t0 = time.perf_counter()
            good, bad = self.link.call(
                lambda c: load_streamed(c, codec, lease_id, spec.block_ids[:n], self._block_ok,
                                        self.timings),
                "load")
            self.timings["stream"] = time.perf_counter() - t0
            if bad:
                self.counters.inc("checksum_errors", len(bad))
                log.warning("kvkeeper: %d block(s) of %s failed their checksum; they are dropped "
                            "from the daemon and recomputed", len(bad), spec.req_id)
        finally:
            if self.releaser is not None:
                self.releaser.release(lease_id, discard_indices=bad)
        return good, bad

    def take_load_errors(self) -> Set[int]:
        self._settle()
        out, self._invalid = self._invalid, set()
        return out

    def build_worker_meta(self) -> Optional[KVKeeperWorkerMetadata]:
        self._settle()
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
        """Queue this step's saves; the save thread copies them out of the KV
        cache. vLLM keeps their blocks until copy_out_for() says they are out."""
        if meta is None or not meta.saves:
            return
        # Jobs copied out already no longer pin anything: forget them.
        for rid in [r for r, jobs in self._save_jobs.items() if all(j.copied for j in jobs)]:
            del self._save_jobs[rid]
        if not self.usable or self._saver is None:
            return
        for spec in meta.saves:
            self._queue_save(spec)

    def _queue_save(self, spec: SaveSpec) -> None:
        assert self.codec is not None and self._saver is not None and self.layout is not None
        keys = spec.keys[self.rank] if self.rank < len(spec.keys) else ()
        n = spec.num_blocks()
        if not n or len(keys) != n:
            return
        if not self._saver.admit(n * self.layout.block_bytes):
            self.counters.inc("save_dropped_blocks", n)
            return
        job = _SaveJob(spec.req_id, keys, spec.block_ids)
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
        self.timings["copy_out_wait"] = time.perf_counter() - t

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
        if self._io_pool is not None:
            self._io_pool.shutdown(wait=False, cancel_futures=True)
        if self._saver is not None:
            self._saver.close(timeout)
        if self.releaser is not None:
            self.releaser.close(0.5)   # closing the session frees whatever is left
        if self.link is not None:
            self.link.close()
