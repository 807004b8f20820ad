"""The CUDA calls of the device path, in one place.

Everything else in kvkeeper.connector.gpu asks an ops object for streams and
events, so the bookkeeping (which stream waits for which event, when a host
thread blocks) is the same code on a GPU and, with a fake ops object and CPU
tensors, in the CPU tests. Copies themselves are plain torch copies with
non_blocking=True: asynchronous from pinned memory on a GPU, immediate on
the CPU.
"""
from __future__ import annotations

from contextlib import AbstractContextManager
from typing import Any

import torch

__all__ = ["CudaOps"]


class CudaOps:
    """One side stream on `device` for kvkeeper's copies, and events on it."""

    pin = True   # host staging tensors are pinned (asynchronous D2H)

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.side = torch.cuda.Stream(device=device)

    def on_side(self) -> AbstractContextManager:
        """Work issued inside runs on the side stream (and allocates there)."""
        return torch.cuda.stream(self.side)

    def current(self) -> Any:
        """The calling thread's current stream: vLLM's compute stream on its thread."""
        return torch.cuda.current_stream(self.device)

    def record(self, stream: Any) -> Any:
        """An event recorded on `stream` now."""
        ev = torch.cuda.Event()
        ev.record(stream)
        return ev

    def wait(self, stream: Any, event: Any) -> None:
        """Work issued on `stream` after this runs after `event`; the host does not wait."""
        stream.wait_event(event)

    def synchronize(self, event: Any) -> None:
        """Block the calling host thread until `event` completed."""
        event.synchronize()

    def done(self, event: Any) -> bool:
        return bool(event.query())

    def to_device(self, t: torch.Tensor) -> torch.Tensor:
        """A small CPU tensor (kernel block ids) on the device, without a
        synchronous copy: pinned by torch's caching host allocator, which
        keeps it until the copy is done."""
        return t.pin_memory().to(self.device, non_blocking=True)
