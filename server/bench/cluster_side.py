"""The cluster benchmark's tier side: a ClusterTier (server/tiers/cluster)
moving blocks between plain host buffers and the cluster, as the tier stack
drives it (write_block from the arena's store, read_block into it, probe_run).

The host side is a minimal BlockStore over numpy arrays offering a zero-copy
view, as the arena's backend does: the tier copies a payload out of it once on
save and into it once on load, exactly the copies it makes against the arena.
Blocks carry their writer's XXH3-64 checksum (computed before timing), as a
committed arena block does; loads verify it, as promotions do.
"""
from __future__ import annotations

import asyncio
from typing import Any, NamedTuple, Optional, Sequence

import numpy as np

from kvkeeper.client.checksum import checksum

from ..tiers.cluster.client import ClusterClient
from ..tiers.cluster.config import ClusterSettings, parse_cluster_url
from ..tiers.cluster.tier import ClusterLoc, ClusterTier
from ..tiers.disk import WRITE_ALGO

NS = bytes(range(16))
KEY_BYTES = 32


class Buffers:
    """Host buffers by index, behind the part of the BlockStore contract the
    tier uses (view, read_into, write)."""

    def __init__(self, arrays: Sequence[np.ndarray]) -> None:
        self.arrays = list(arrays)

    def view(self, i: int) -> memoryview:
        return memoryview(self.arrays[i]).cast("B")

    def read_into(self, i: int, out: Any) -> None:
        memoryview(out).cast("B")[:] = self.view(i)

    def write(self, i: int, data: Any, checksum: Any = None) -> int:
        self.view(i)[:] = memoryview(data).cast("B")
        return len(self.arrays[i])


class Handle(NamedTuple):
    loc: ClusterLoc
    index: int
    checksum: tuple[int, int]


class TierSide:
    def __init__(self, tier: ClusterTier, where: str) -> None:
        self.tier = tier
        self.where = where
        self.suffix = "" if where == "single" else f".{where}"
        self.src = Buffers([])
        self.dst = Buffers([])

    @classmethod
    async def open(cls, url: str, where: str, max_keys_per_call: int = 256) -> "TierSide":
        # The tier's timeout is generous: the benchmark measures bandwidth, a
        # loaded 2-core machine must not turn slow calls into dropped writes.
        settings = ClusterSettings(url=parse_cluster_url(url), timeout_s=30.0,
                                   max_keys_per_call=max_keys_per_call)
        side = cls(ClusterTier(settings, ClusterClient(settings, None)), where)
        # Connect (and learn the slot map) before the first burst of calls, as
        # the daemon's start-up check and memory poll do before traffic comes.
        await side.tier.client.ping()
        await side.tier.refresh_memory()
        return side

    @staticmethod
    def keys(n: int, rnd: int) -> list[bytes]:
        return [(rnd << 40 | i).to_bytes(KEY_BYTES, "big") for i in range(n)]

    def prepare(self, keys: Sequence[bytes], blocks: Sequence[np.ndarray]) -> list[Handle]:
        """Locations, host buffers and writer checksums of the blocks (untimed)."""
        self.src = Buffers(blocks)
        self.dst = Buffers([np.zeros_like(b) for b in blocks])
        sums = {id(b): (WRITE_ALGO, checksum(WRITE_ALGO, b)) for b in blocks}
        return [Handle(self.tier.loc(NS, k, b.nbytes), i, sums[id(b)])
                for i, (k, b) in enumerate(zip(keys, blocks))]

    async def save(self, handles: Sequence[Handle]) -> None:
        await asyncio.gather(*(self.tier.write_block(self.src, h.index, h.loc, h.checksum)
                               for h in handles))

    async def load(self, handles: Sequence[Handle]) -> None:
        await asyncio.gather(*(self.tier.read_block(h.loc, self.dst, h.index) for h in handles))

    async def probe(self, handles: Sequence[Handle]) -> int:
        sizes = await self.tier.probe_run(NS, [h.loc.key for h in handles])
        n = 0
        while n < len(sizes) and sizes[n] is not None:
            n += 1
        return n

    def check(self, handles: Sequence[Handle], blocks: Sequence[np.ndarray]) -> None:
        """Every loaded block equals what was saved (untimed): the tier moved the bytes."""
        for h in handles:
            if not np.array_equal(self.dst.arrays[h.index], blocks[h.index]):
                raise RuntimeError(f"block {h.index} came back different from the cluster")
            self.dst.arrays[h.index][:] = 0

    def faults(self) -> int:
        return sum(self.tier.client.faults.values()) + self.tier.flush_failures

    async def close(self) -> None:
        await self.tier.close()


__all__ = ["Buffers", "Handle", "TierSide"]
