"""Shared by the disk index tests (test_disk_index*.py)."""
from __future__ import annotations

from kvkeeper.server.ledger.disk_index import DiskIndex

NS = bytes(range(16))
B = 100  # bytes per entry in most tests


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def lru_order(ix: DiskIndex) -> list[int]:
    """The keys (as ints) of the unpinned stored entries, the next victim first."""
    return [int.from_bytes(e.where[1], "big") for e in ix.eviction_order()]
