"""The caller's keys and block buffers, checked before anything is sent.

A wrong key or block size is the caller's mistake: it gets a ValueError
naming the offending item, and no RPC is made.
"""
from __future__ import annotations

from typing import Any, List, Sequence

from .checksum import byte_view

__all__ = ["check_keys", "block_views"]


def check_keys(keys: Sequence[bytes], key_bytes: int) -> List[bytes]:
    """`keys` as a list of bytes, each `key_bytes` long (any length when 0)."""
    kb = key_bytes
    # Fast path, C-level passes only: a list of bytes of the right length.
    if (type(keys) is list and set(map(type, keys)) <= {bytes}
            and (not kb or set(map(len, keys)) <= {kb})):
        return keys
    out = [bytes(k) for k in keys]
    if kb:
        for i, k in enumerate(out):
            if len(k) != kb:
                raise ValueError(f"key {i} has {len(k)} bytes; the daemon expects {kb}")
    return out


def block_views(blocks: Sequence[Any], block_bytes: int, writable: bool) -> List[memoryview]:
    """Flat byte views of `blocks`, each exactly `block_bytes` long; a
    writable destination may be longer (its first block_bytes are used)."""
    bb = block_bytes
    views = []
    for i, b in enumerate(blocks):
        try:
            v = byte_view(b, writable=writable)
        except ValueError as e:
            raise ValueError(f"block {i}: {e}") from None
        if writable and v.nbytes >= bb:
            v = v[:bb]
        if v.nbytes != bb:
            raise ValueError(f"block {i} has {v.nbytes} bytes; the namespace's block_bytes "
                             f"is {bb}")
        views.append(v)
    return views
