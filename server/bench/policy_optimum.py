"""The offline optimum of a trace: Belady's MIN over blocks, with bypass.

Every block a request looks up or saves is, right after that request, a
candidate to keep (it was just computed or loaded); the cache keeps the C
candidates whose next lookup comes soonest, and a block whose next lookup
is later than every cached one's is left out (bypass). That is optimal for
block hits among all caches of C blocks that know the future.

With chained keys it is also exact for the ledger's hits, which count only
the leading blocks of a lookup: a block is looked up only right after its
parent, so its next lookup is always later than its parent's, MIN evicts a
child before its parent, and its cache is always a set of whole prefixes
(every cached block is a leading hit). Hits are counted the ledger's way
anyway: the leading blocks of each prompt that are cached.
"""
from __future__ import annotations

import heapq
import math
from typing import Sequence

from .policy_trace import Request


def next_uses(requests: Sequence[Request]) -> list[list[float]]:
    """For each request and each of its keys, when the key is next looked up
    (as a global event number; inf: never)."""
    out: list[list[float]] = [[] for _ in requests]
    nxt: dict[bytes, float] = {}
    t = sum(len(r.keys) for r in requests)
    for i in range(len(requests) - 1, -1, -1):
        r = requests[i]
        t -= len(r.keys)
        row = [math.inf] * len(r.keys)
        for j in range(len(r.keys) - 1, -1, -1):
            k = r.keys[j]
            row[j] = nxt.get(k, math.inf)
            if j < r.prompt_blocks:
                nxt[k] = t + j
        out[i] = row
    return out


def optimum_hits(requests: Sequence[Request], capacity: int) -> tuple[int, int]:
    """(hit blocks, looked-up blocks) of the offline optimum with `capacity` blocks."""
    return min_hits(requests, next_uses(requests), capacity)


def min_hits(requests: Sequence[Request], uses: Sequence[Sequence[float]],
             capacity: int) -> tuple[int, int]:
    """(hit blocks, looked-up blocks) of MIN driven by `uses` (next_uses' shape:
    when each key of each request is believed to be looked up next). A cached
    key whose believed next lookup passed without it (policy_blind.py's
    phantom turns; never with next_uses, where a key is looked up when
    believed) is believed never looked up again, so it leaves at once."""
    cached: dict[bytes, float] = {}        # key -> its next use
    heap: list[tuple[float, bytes]] = []   # (-next use, key), stale entries skipped
    due: list[tuple[float, bytes]] = []    # (next use, key): the ones that may pass
    hits = asked = 0
    t = 0                                  # the event number of the request's first key
    for r, row in zip(requests, uses):
        while due and due[0][0] < t:       # believed looked up by now, and was not
            nu, k = heapq.heappop(due)
            if cached.get(k) == nu:
                del cached[k]
        t += len(r.keys)
        asked += r.prompt_blocks
        for k in r.keys[:r.prompt_blocks]:
            if k not in cached:
                break
            hits += 1
        for k, nu in zip(r.keys, row):
            if k in cached:
                if nu == math.inf:
                    del cached[k]          # never looked up again: free its room now
                else:
                    cached[k] = nu
                    heapq.heappush(heap, (-nu, k))
                    heapq.heappush(due, (nu, k))
                continue
            if nu == math.inf or capacity <= 0:
                continue
            if len(cached) >= capacity:
                while True:                # the cached block looked up last
                    far, victim = heap[0]
                    if cached.get(victim) == -far:
                        break
                    heapq.heappop(heap)
                if -far <= nu:
                    continue               # bypass: it is needed later than all of them
                heapq.heappop(heap)
                del cached[victim]
            cached[k] = nu
            heapq.heappush(heap, (-nu, k))
            heapq.heappush(due, (nu, k))
        if len(heap) > 4 * capacity + 1024:   # drop stale entries now and then
            heap = [(-v, k) for k, v in cached.items()]
            heapq.heapify(heap)
            due = [(v, k) for k, v in cached.items()]
            heapq.heapify(due)
    return hits, asked
