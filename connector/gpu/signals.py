"""LayerSignal: "layer l is loaded" when the copies run on a side stream.

The worker's wait_for_layer_load(l) asks StepLoads.layer_done[l] is_set()
and else wait(timeout), the interface of threading.Event that the CPU
strategies set from their copying thread. On a GPU the copies are issued
before the forward and complete on the side stream, so waiting is a device
matter: wait() makes the calling thread's current stream (vLLM's compute
stream, on its thread) wait for the layer's group event and returns at once.
The host never blocks, and layer l's attention runs as soon as its group is
in, while later groups are still being copied.
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["LayerSignal"]


class LayerSignal:
    """One layer's copy event for StepLoads.layer_done (duck-types threading.Event)."""

    __slots__ = ("_ops", "_pending", "event")

    def __init__(self, ops: Any) -> None:
        self._ops = ops
        self._pending = True          # its copies are not issued yet
        self.event: Optional[Any] = None

    def arm(self, event: Any) -> None:
        """Its copies are issued; `event` completes once they are done."""
        self.event = event
        self._pending = False

    def set(self) -> None:
        """Nothing to wait for (no copy for this layer, or given up)."""
        self.event = None
        self._pending = False

    def is_set(self) -> bool:
        return not self._pending and self.event is None

    def wait(self, timeout: Optional[float] = None) -> bool:
        """The current stream waits for the layer's copies (the host does not).
        False only if the copies were never issued: the caller gives up on
        the step, as when a CPU copy does not finish in time."""
        if self._pending:
            return False
        if self.event is not None:
            self._ops.wait(self._ops.current(), self.event)
        return True
