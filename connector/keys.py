"""Chained block keys: kvkeeper.client.keys, where the one copy of the key code
lives (a router outside the engines computes keys with it too); see there."""
from __future__ import annotations

from kvkeeper.client.keys import (KEY_BYTES, NAMESPACE_FIELDS, KeyChain, RequestSeeds,
                                  block_tokens_bytes, chain_keys, full_blocks, hit_tokens,
                                  matchable_blocks, namespace_seed)

__all__ = [
    "KEY_BYTES", "NAMESPACE_FIELDS", "namespace_seed", "block_tokens_bytes", "chain_keys",
    "KeyChain", "RequestSeeds", "full_blocks", "matchable_blocks", "hit_tokens",
]
