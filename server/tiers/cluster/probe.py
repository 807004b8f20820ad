"""The chain probe: which leading blocks of a chain the cluster holds now.

The daemon keeps no mirror of the cluster (its maxmemory policy evicts what
it likes, other daemons write): every lookup asks. One pipelined STRLEN per
key, up to max_keys_per_call keys in one call, costs one round trip per
node holding some of them (the cluster client sends each node its share at
once); STRLEN says both whether the value is there and how big its payload
is, which the ledger needs to book a found copy. Only the leading run
counts: a chain is usable up to its first missing block.
"""
from __future__ import annotations

from typing import Optional, Sequence

from .client import ClusterClient, ClusterFault
from .format import payload_bytes_of, redis_key


def answers(value_bytes: Sequence[Optional[int]]) -> list[Optional[int]]:
    """The payload size for each STRLEN answer (None for a missing value, an
    erroring node, or a value too short to be a block)."""
    return [payload_bytes_of(n) if isinstance(n, int) else None for n in value_bytes]


async def probe_chain(client: ClusterClient, prefix: bytes, ns: bytes,
                      keys: Sequence[bytes], max_keys: int) -> list[Optional[int]]:
    """What the cluster holds of the first `max_keys` of `keys`: each one's
    payload size or None; a fault is [] (counted by the client)."""
    ask = [redis_key(prefix, ns, k) for k in keys[:max_keys]]
    if not ask:
        return []
    try:
        return answers(await client.strlens(ask))
    except ClusterFault:
        return []
