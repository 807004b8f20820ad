"""Capacity of one tier: pages, the eviction policy over its unreferenced blocks,
and the counters that metrics read at scrape time."""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any

from ..ids import TierName
from .cooling import Cooling
from .pages import PageAllocator
from .chains import ChainPolicy
from .policy import make_policy


@dataclass(frozen=True)
class TierSpec:
    name: TierName
    capacity_bytes: int
    page_bytes: int

    @property
    def capacity_pages(self) -> int:
        return self.capacity_bytes // self.page_bytes


class Tier:
    def __init__(self, spec: TierSpec, policy: str) -> None:
        if spec.page_bytes <= 0 or spec.capacity_pages <= 0:
            raise ValueError(
                f"tier {spec.name}: capacity {spec.capacity_bytes} B holds no page of {spec.page_bytes} B")
        self.spec = spec
        self.name = spec.name
        self.page_bytes = spec.page_bytes
        self.pages = PageAllocator(spec.capacity_pages)
        self.cooling = Cooling(self.pages)   # ended by the daemon: a late writer's (cooling.py)
        # The configured order, leaves first and strays first (chains.py).
        self.policy: ChainPolicy = ChainPolicy(make_policy(policy))
        self.evictable_pages = 0
        self.blocks = 0
        self.pending_blocks = 0
        # Monotonic counters, read by the metrics collector.
        self.evictions: Counter[str] = Counter()
        self.hit_blocks = 0
        self.hit_tokens = 0
        self.committed_blocks = 0
        self.committed_bytes = 0
        # Where its blocks' stored / removed events go (events.TierEvents), if anywhere.
        self.events: Any = None
        self.admission_refused = 0    # new blocks its policy's admit_run refused
        self.last_turn_demoted = 0    # blocks a last turn's release demoted (books.demote)

    @property
    def capacity_pages(self) -> int:
        return self.pages.total

    @property
    def used_pages(self) -> int:
        return self.pages.total - self.pages.free_pages

    @property
    def free_pages(self) -> int:
        return self.pages.free_pages

    @property
    def pinned_pages(self) -> int:
        """Pages that eviction cannot take: referenced or still being written."""
        return self.used_pages - self.evictable_pages
