"""What a peer segment is: an engine's KV cache memory as another process maps it.

A holder (an engine's worker) registers two descriptors: its KV cache
(`kv_bytes`, every layer's blocks at `offset + block * stride` for
`layer_bytes` each, in the layer order of the namespace's block format) and
its generation array: GEN_BYTES-byte little-endian counters, one per vLLM
block, plus one slot after the last (ATTACHED_SLOT(num_blocks)) that the
holder's scheduler sets to 1 once it bumps a block's generation before every
reuse of that block. Published entries name (key, block, generation); a
block whose generation differs from its entry's no longer holds that key.
Without the attached flag nothing the holder published may be copied.

check_descriptor is the one validation: the daemon runs it at registration
and a peer before mapping anything, so no copy reads outside the mapping.
"""
from __future__ import annotations

from typing import Any, List, Mapping

__all__ = ["ATTACHED", "DESCRIPTOR_VERSION", "GEN_BYTES", "attached_slot", "check_descriptor",
           "gens_bytes"]

DESCRIPTOR_VERSION = 1
GEN_BYTES = 8
ATTACHED = 1


def attached_slot(num_blocks: int) -> int:
    return num_blocks


def gens_bytes(num_blocks: int) -> int:
    """Bytes of the generation array of a cache of `num_blocks` blocks."""
    return (num_blocks + 1) * GEN_BYTES


def _int(d: Mapping[str, Any], key: str, problems: List[str], low: int = 0) -> int:
    v = d.get(key)
    if not isinstance(v, int) or isinstance(v, bool) or v < low:
        problems.append(f"{key} must be an integer >= {low}, got {v!r}")
        return low
    return v


def check_descriptor(d: Any, kv_size: int, gens_size: int) -> List[str]:
    """What is wrong with descriptor `d` of a KV segment of `kv_size` bytes and
    a generation array of `gens_size` bytes (empty: nothing)."""
    if not isinstance(d, Mapping):
        return [f"the descriptor must be an object, got {type(d).__name__}"]
    problems: List[str] = []
    if d.get("version") != DESCRIPTOR_VERSION:
        problems.append(f"descriptor version {d.get('version')!r} is not {DESCRIPTOR_VERSION}")
    n = _int(d, "num_blocks", problems, 1)
    bb = _int(d, "block_bytes", problems, 1)
    lb = _int(d, "layer_bytes", problems, 1)
    kv = _int(d, "kv_bytes", problems, 1)
    layers = d.get("layers")
    if not isinstance(layers, list) or not layers:
        problems.append("layers must be a non-empty list of [offset, stride]")
        return problems
    if problems:
        return problems
    if kv != kv_size:
        problems.append(f"kv_bytes is {kv} but the KV descriptor maps {kv_size} bytes")
    if gens_size < gens_bytes(n):
        problems.append(f"the generation array holds {gens_size} bytes, {gens_bytes(n)} needed "
                        f"for {n} blocks")
    if lb * len(layers) != bb:
        problems.append(f"{len(layers)} layers of {lb} bytes do not make blocks of {bb} bytes")
    for i, span in enumerate(layers):
        if (not isinstance(span, list) or len(span) != 2
                or not all(isinstance(x, int) and not isinstance(x, bool) and x >= 0
                           for x in span)):
            problems.append(f"layer {i}: expected [offset, stride] of integers >= 0, got {span!r}")
            continue
        off, stride = span
        if stride < lb:
            problems.append(f"layer {i}: a stride of {stride} bytes overlaps blocks of {lb}")
        elif off + (n - 1) * stride + lb > kv_size:
            problems.append(f"layer {i}: its {n} blocks end past the segment's {kv_size} bytes")
    return problems
