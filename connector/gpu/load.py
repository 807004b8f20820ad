"""CudaLoad: the load strategy of a KV cache on a CUDA device.

Chosen instead of the CPU strategies (load/choice.py) when the KV tensors
are on CUDA (see __init__.py). Before fetching it has the client's arena
mapping registered as pinned memory (once per mapping); start() checks
every fetched block on the host and issues the copies of the good ones on
the side stream (h2d.py), layer group by layer group, returning before any
of them ran: step.layer_done holds LayerSignals, so wait_for_layer_load(l)
makes the compute stream wait for layer l's group and attention of the
first layers overlaps the copies of the later ones. The I/O thread then
waits for the last copy on the host and only then releases the leases (the
DMA reads the arena until then); the worker settles the step after the
forward, as for the beside-the-forward CPU strategy.

The block the forward writes into (fetch.py copies it before the forward,
through BlockLoader.copy_in) comes here too (copy_in): checked, then copied
on the side stream, the compute stream waiting for it.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, List, Optional, Sequence

import torch

from ..io_thread import IoThread
from ..load.copy_in import BlockLoader
from ..load.step import FetchedLoad, StepLoads
from ..load.strategy import LoadStrategy
from .h2d import DeviceLoader

__all__ = ["CudaLoad"]

log = logging.getLogger("kvkeeper.connector")


class CudaLoad(LoadStrategy):
    name = "cuda"
    beside_forward = True

    def __init__(self, loader: BlockLoader, io: IoThread, device: DeviceLoader,
                 link: Optional[Any]) -> None:
        super().__init__(loader, io)
        self.device = device
        self._link = link
        loader.device = self    # single blocks copied before the forward: copy_in below

    def paced_layers(self) -> Sequence[str]:
        return self.loader.codec.layer_names

    def fetch(self, fetch_all: Callable[[], List[FetchedLoad]]) -> List[FetchedLoad]:
        self._pin()
        return fetch_all()

    def _pin(self) -> None:
        pinned = self.device.pinned
        if pinned is None or self._link is None:
            return
        try:
            mapping = self._link.call(lambda c: c.arena_mapping, "pin", wait=False)
        except Exception as e:  # noqa: BLE001 - unpinned copies still work
            log.debug("kvkeeper: no arena mapping to pin: %s", e)
            return
        pinned.ensure(mapping)

    def _check(self, f: FetchedLoad, lo: int, hi: int) -> int:
        """Check blocks lo..hi-1 of f on the host (each once); the first bad one, or hi."""
        for i in range(lo, hi):
            if i not in f.checked:
                f.checked[i] = self.loader.fetched_ok(f, i)
        return next((i for i in range(lo, hi) if not f.checked[i]), hi)

    def copy_in(self, f: FetchedLoad, lo: int, hi: int) -> None:
        """BlockLoader.copy_in on the device: check, then copy the leading good
        blocks, the compute stream waiting for them."""
        assert f.sources is not None
        good = self._check(f, lo, hi)
        ops = self.device.ops
        ev = self.device.copy(f.spec.block_ids[lo:good], f.sources[lo:good])
        if ev is not None:
            ops.wait(ops.current(), ev)

    def start(self, step: StepLoads) -> None:
        loader, device = self.loader, self.device
        signals = device.signals()
        step.layer_done.update(signals)
        ids: List[int] = []
        sources: List[torch.Tensor] = []
        done = None
        t0 = time.perf_counter()
        try:
            for f in step.fetched:
                if f.sources:
                    self._check(f, 0, f.copy_n)
                loader.set_bad(f, loader.bad_in(f, 0, f.n))
                g = min(f.good, f.copy_n) if f.sources else 0
                ids += f.spec.block_ids[:g]
                sources += f.sources[:g] if f.sources else []
            t1 = time.perf_counter()
            step.timings.check = t1 - t0
            done = device.copy(ids, sources, signals)
            step.timings.copy = time.perf_counter() - t1
        except Exception as e:  # noqa: BLE001
            log.warning("kvkeeper: copying loaded blocks into the KV cache failed: %s", e,
                        exc_info=True)
            step.abandoned = True
            for s in signals.values():
                s.set()
            done = device.ops.record(device.ops.side)   # whatever was issued before
        step.future = self.io.submit(self._finish, step, done)

    def _finish(self, step: StepLoads, done: Optional[Any]) -> None:
        """On the I/O thread: release the leases once the copies read the arena."""
        if done is not None:
            self.device.ops.synchronize(done)
        self.loader.release(step)

    def close(self) -> None:
        """Unregister the pinned arena mapping (worker shutdown), once no copy
        issued on the side stream can still be reading it."""
        ops = self.device.ops
        try:
            ops.synchronize(ops.record(ops.side))
        finally:
            if self.device.pinned is not None:
                self.device.pinned.close()
