"""Shared by the policy tests: a stand-in block and a drain."""
from __future__ import annotations

from kvkeeper.server.ledger.policy import EvictionPolicy


class Blk:
    __slots__ = ("name", "key", "where", "hits", "prev", "next", "pq", "child")

    def __init__(self, name: str, hits: int = 0) -> None:
        self.name, self.hits = name, hits
        self.key = name.encode()
        self.where = (b"ns", self.key)   # what s3fifo's ghosts remember
        self.prev = self.next = None
        self.pq = 0
        self.child = None    # chains.py: a cached child (admit_run reads it)

    def __repr__(self) -> str:
        return f"Blk({self.name}, hits={self.hits})"


def drain(p: EvictionPolicy) -> list[str]:
    out = []
    while (b := p.pop()) is not None:
        out.append(b.name)
    return out
