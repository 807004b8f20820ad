"""What clients asked of the daemon and loaded from it: the counters behind hit rates.

A plain Match counts every key it names as asked and every block it finds
as a hit. That is wrong for vLLM's connector: it looks a prompt up from
block 0 before vLLM says how much of it vLLM holds in its own prefix cache,
and then loads only the blocks beyond. So a Match with `report_use` counts
nothing here, and the client reports afterwards, with the Release, what the
lookup was for (a LookupReport): the prompt, the blocks it held itself, the
blocks it loaded. Those loaded blocks are the hits.

Tokens are a property of the prompt, not of a TP shard: every TP rank has
its own session, namespace and blocks, so block counters add up over ranks
while token counters count only on rank 0's namespaces. A TP engine's
prompt then counts once, as in vLLM's own counters.

Hits count whole blocks: the daemon serves a block's KV whole, so a hit
ending one token short of a block boundary (vLLM recomputes a prompt's last
token) counts the block's tokens all the same; vLLM's
`vllm:kvkeeper_hit_tokens_total` counts one token fewer for such a hit.
"""
from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Mapping, Sequence

from ..errors import InvalidArgument
from ..ids import TierName
from .records import Block, Namespace
from .tier import Tier

__all__ = ["LookupReport", "Usage", "counts_tokens"]


@dataclass(frozen=True)
class LookupReport:
    """One lookup of a prompt's full blocks, as the client used it (mirrors
    kvkeeper.v1.LookupReport)."""

    prompt_tokens: int
    prompt_blocks: int
    local_blocks: int
    loaded_blocks: int

    def validate(self, block_tokens: int) -> None:
        for name in ("prompt_tokens", "prompt_blocks", "local_blocks", "loaded_blocks"):
            if getattr(self, name) < 0:
                raise InvalidArgument(f"report.{name} is negative")
        if self.prompt_blocks * block_tokens > self.prompt_tokens:
            raise InvalidArgument(
                f"report: {self.prompt_blocks} full blocks of {block_tokens} tokens do not fit in "
                f"a prompt of {self.prompt_tokens} tokens")
        if self.local_blocks + self.loaded_blocks > self.prompt_blocks:
            raise InvalidArgument(
                f"report: {self.local_blocks} local and {self.loaded_blocks} loaded blocks are "
                f"more than the prompt's {self.prompt_blocks} full blocks")


def counts_tokens(ns: Namespace) -> bool:
    """Whether token counters count for this namespace: TP rank 0's only."""
    return ns.descriptor.tp_rank == 0


class Usage:
    """Monotonic counters of lookups beyond the clients' own caches and of the
    prompts they reported; read by the metrics collector."""

    def __init__(self) -> None:
        self.lookup_blocks = 0   # blocks asked of the daemon (beyond what clients hold)
        self.lookup_tokens = 0
        self.prompt_blocks = 0   # full blocks of the prompts clients reported
        self.prompt_tokens = 0
        self.reports = 0
        # Tokens of the hits each lower tier served (its book counts their blocks).
        self.lower_hit_tokens: Counter[TierName] = Counter()

    def asked(self, ns: Namespace, blocks: int) -> None:
        self.lookup_blocks += blocks
        if counts_tokens(ns):
            self.lookup_tokens += blocks * ns.block_tokens

    def reported(self, ns: Namespace, report: LookupReport) -> None:
        self.reports += 1
        self.prompt_blocks += report.prompt_blocks
        if counts_tokens(ns):
            self.prompt_tokens += report.prompt_tokens
        self.asked(ns, report.prompt_blocks - report.local_blocks)

    def hits(self, ns: Namespace, hit: Sequence[Block], top: Tier, single_tier: bool,
             below: Mapping[int, TierName] = {}, first: int = 0) -> None:
        """Count `hit` (blocks at lookup positions first, first+1, ...) as hits of
        their tiers; the blocks at positions in `below` were served by the lower
        tier named there, whose book counted the block when it served it: their
        tokens count here, as that tier's."""
        if not hit:
            return
        tokens = ns.block_tokens if counts_tokens(ns) else 0
        if single_tier and not below:
            top.hit_blocks += len(hit)
            top.hit_tokens += len(hit) * tokens
            return
        for i, b in enumerate(hit, start=first):
            tier = below.get(i)
            if tier is not None:
                self.lower_hit_tokens[tier] += tokens
            else:
                b.tier.hit_blocks += 1
                b.tier.hit_tokens += tokens
