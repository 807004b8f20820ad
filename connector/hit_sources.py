"""Where a hit's tokens came from, for vLLM's get_external_cache_hit_sources.

A lookup's Match answers the tier of each matched block (kvkeeper_pb2.Tier:
host, disk; a block a lower tier served was promoted into the host tier
first, but it is that tier's hit). A hit loads the tokens
[computed, computed + n) of the request, whole blocks from `start` on; each
token counts for its block's tier. vLLM's CacheHitSource values are the
names used here: "host", "disk", "p2p" (another engine's cache, issue 14's
peer loads: TIER_GPU).
"""
from __future__ import annotations

from typing import Any, Dict, Sequence

__all__ = ["SOURCE_OF_TIER", "lease_sources", "split_hit"]

# kvkeeper_pb2.Tier values -> vLLM CacheHitSource values.
SOURCE_OF_TIER = {1: "p2p", 2: "host", 3: "disk"}


def split_hit(tiers: Sequence[int], start: int, computed: int, n: int,
              block_tokens: int) -> Dict[str, int]:
    """Tokens per source of a hit of `n` tokens after `computed`, loaded from
    block `start` on; `tiers[i]` is request block i's tier. Sums to n, or {}
    when the tiers do not cover the hit (the caller falls back to one source)."""
    out: Dict[str, int] = {}
    end = computed + n
    first = max(start, computed // block_tokens)
    last = -(-end // block_tokens)
    if n <= 0 or last > len(tiers):
        return {}
    for i in range(first, last):
        lo, hi = max(computed, i * block_tokens), min(end, (i + 1) * block_tokens)
        src = SOURCE_OF_TIER.get(tiers[i])
        if src is None:
            return {}
        if hi > lo:
            out[src] = out.get(src, 0) + hi - lo
    return out if sum(out.values()) == n else {}


def lease_sources(lease: Any, n: int, block_tokens: int) -> Dict[str, int]:
    """split_hit of a hit of n tokens from a lookup's lease (lookup.Lease)."""
    return split_hit(lease.tiers, lease.start, lease.computed, n, block_tokens)
