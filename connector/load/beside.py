"""BesideLoad: a step's loads copied and checked on the I/O thread, on a
spare core, beside the forward: each layer's event is set once that layer
of every block is in, and wait_for_layer_load waits for it. Fetching stays
in vLLM's thread (LoadStrategy.fetch), which waits for it anyway: handing
it to the I/O thread only added a thread switch before the forward."""
from __future__ import annotations

from typing import Sequence

from .step import StepLoads
from .strategy import LoadStrategy

__all__ = ["BesideLoad"]


class BesideLoad(LoadStrategy):
    name = "beside"
    beside_forward = True

    def paced_layers(self) -> Sequence[str]:
        return self.loader.codec.layer_names

    def start(self, step: StepLoads) -> None:
        step.future = self.io.submit(self.loader.copy_and_check, step)
