"""LoadStrategy: where a step's loads are copied into the KV cache and checked.

Where that work runs is chosen once, when the KV cache is registered, from
kvkeeper_load_overlap and the spare cores vLLM's CPU backend leaves to the
rest of the engine (cpus.py; choice.py picks):

  beside (beside.py)  two or more spare cores: copied on the I/O thread
                      there, layer by layer beside the forward;
                      wait_for_layer_load(l) waits only for layer l, so
                      attention on the first layers runs while later ones are
                      copied, and the checksums are checked while the forward
                      runs.
  halves (halves.py)  one spare core (the engine core busy-polls it): before
                      the forward, the I/O thread doing half of it.
  inline (inline.py)  none: before the forward, in vLLM's thread.

vLLM takes the load errors after the forward (get_block_ids_with_load_errors)
and drops that step's output for a request whose blocks failed, so a block
checked after its attention ran is still never served: it is recomputed. The
block the forward itself writes into (the prompt's last token) is always
checked before the forward (fetch.py).

Streamed loads (no mapped arena) are not a strategy: they are copied and
checked as their chunks arrive, while fetching (fetch.py, stream.py).
"""
from __future__ import annotations

from abc import ABC, abstractmethod
from typing import Callable, ClassVar, List, Sequence

from ..io_thread import IoThread
from .copy_in import BlockLoader
from .step import FetchedLoad, StepLoads

__all__ = ["LoadStrategy"]


class LoadStrategy(ABC):
    """One way of running a step's loads; the worker calls fetch, then start."""

    name: ClassVar[str]
    # Whether copies and checks may still run when start returns. The worker
    # then settles the step after the forward; otherwise right away.
    beside_forward: ClassVar[bool] = False

    def __init__(self, loader: BlockLoader, io: IoThread) -> None:
        self.loader = loader
        self.io = io

    def fetch(self, fetch_all: Callable[[], List[FetchedLoad]]) -> List[FetchedLoad]:
        """Run the step's fetching; here, in vLLM's thread: nothing to gain
        from a hop to the I/O thread when the RPC is waited for anyway."""
        return fetch_all()

    def paced_layers(self) -> Sequence[str]:
        """The layers wait_for_layer_load waits for: those copied beside the forward."""
        return ()

    @abstractmethod
    def start(self, step: StepLoads) -> None:
        """Copy the step's fetched blocks in, check them and release their
        leases: done on return, or begun (step.future) if beside_forward.
        Failures are recorded on the step (step.abandoned, f.good), never raised."""
