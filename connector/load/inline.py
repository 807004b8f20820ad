"""InlineLoad: a step's loads copied and checked before the forward, in
vLLM's thread (no spare core, or kvkeeper_load_overlap=off)."""
from __future__ import annotations

from .step import StepLoads
from .strategy import LoadStrategy

__all__ = ["InlineLoad"]


class InlineLoad(LoadStrategy):
    name = "inline"

    def start(self, step: StepLoads) -> None:
        self.loader.copy_and_check(step)
