"""choose_load_strategy: the one LoadStrategy a worker uses, picked at start-up."""
from __future__ import annotations

from typing import Type

from .beside import BesideLoad
from .halves import HalvesLoad
from .inline import InlineLoad
from .strategy import LoadStrategy

__all__ = ["choose_load_strategy"]


def choose_load_strategy(load_overlap: str, spare_cores: int) -> Type[LoadStrategy]:
    """kvkeeper_load_overlap (on / off / auto) and the spare cores -> the strategy.
    on: beside the forward wherever there is a spare core; auto: with two or
    more, and with one (which the engine core's busy polling shares: "on"
    measured slower there) halves before the forward; off, or no spare core:
    inline."""
    if load_overlap == "on":
        return BesideLoad if spare_cores >= 1 else InlineLoad
    if load_overlap == "auto":
        if spare_cores >= 2:
            return BesideLoad
        if spare_cores == 1:
            return HalvesLoad
    return InlineLoad
