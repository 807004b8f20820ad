"""Which blocks of a trace are read again, and what that knowledge is worth.

Two measures for the policy benchmark, both from the trace's future, so both
are analysis, never something the daemon can do online:

* The dead share: the share of the cache's blocks, sampled through a replay,
  that no later lookup reads (a one-off tail, the history of a conversation
  that ended). The optimum holds none (it frees a block at its last lookup);
  whatever an online policy holds of it is room the optimum spends on hits.
* A told replay: the same policy, driven by a client that knows which blocks
  are read again, the way a client with perfect hints could drive the daemon:
  it saves only the part of a chain that a later lookup reads (the live part
  of a chain is a prefix of it: a lookup that reads a block reads its
  ancestors) and releases its lease discarding the blocks nobody reads again.
  The policy then orders live blocks only; what is left between it and the
  optimum is the timing of the next reads, which no hint of "read again or
  not" carries.

So (optimum - policy) splits into (optimum - told) + (told - policy): the
second part is what a policy could win by telling the dead from the live.
"""
from __future__ import annotations

from typing import Iterable, Sequence

from .policy_trace import Request


def last_lookups(requests: Sequence[Request]) -> dict[bytes, int]:
    """For each key a prompt looks up, the index of the last request that does."""
    last: dict[bytes, int] = {}
    for i, r in enumerate(requests):
        for k in r.keys[:r.prompt_blocks]:
            last[k] = i
    return last


def live_prefix(keys: Sequence[bytes], last: dict[bytes, int], now: int) -> int:
    """How many leading `keys` a request after `now` looks up (the rest are dead)."""
    n = 0
    for k in keys:
        if last.get(k, -1) <= now:
            break
        n += 1
    return n


class DeadShare:
    """Time-averaged share of the cached blocks that no later lookup reads."""

    def __init__(self, last: dict[bytes, int]) -> None:
        self.last = last
        self.dead = 0
        self.cached = 0

    def sample(self, keys: Iterable[bytes], now: int) -> None:
        """Count the cached `keys` (after request `now`) and the dead among them."""
        last = self.last
        for k in keys:
            self.cached += 1
            if last.get(k, -1) <= now:
                self.dead += 1

    @property
    def share(self) -> float:
        return self.dead / self.cached if self.cached else 0.0
