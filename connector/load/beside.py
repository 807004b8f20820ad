"""BesideLoad: a step's loads fetched, copied and checked on the I/O thread,
on a spare core, beside the forward: each layer's event is set once that
layer of every block is in, and wait_for_layer_load waits for it."""
from __future__ import annotations

from typing import Callable, List, Sequence

from .step import FetchedLoad, StepLoads
from .strategy import LoadStrategy

__all__ = ["BesideLoad"]


class BesideLoad(LoadStrategy):
    name = "beside"
    beside_forward = True

    def fetch(self, fetch_all: Callable[[], List[FetchedLoad]]) -> List[FetchedLoad]:
        fut = self.io.submit(fetch_all)
        try:
            return fut.result(timeout=self.io.wait_s)
        except BaseException:
            fut.cancel()
            raise

    def paced_layers(self) -> Sequence[str]:
        return self.loader.codec.layer_names

    def start(self, step: StepLoads) -> None:
        step.future = self.io.submit(self.loader.copy_and_check, step)
