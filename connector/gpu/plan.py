"""Which host<->device copies a set of blocks takes (pure Python, no torch).

A block is its layers' pages one after the other (layout.py), so any run of
consecutive layers of one block is one contiguous span of its host bytes.
A load copies the layers in groups, each group of every block in one
host-to-device copy, and signals each group as soon as it is in: the
attention of group g's layers can then run while group g + 1 is copied.
Small copies waste the DMA engine (each costs a few microseconds to issue
and to start, whatever its size), so a group holds the fewest consecutive
layers whose bytes reach min_copy_bytes; large layers get a group each.

Where a group is the whole block, blocks lying one after the other in the
arena (a lease saved in one reservation, often) are copied together in one
run, into consecutive staging rows.
"""
from __future__ import annotations

from typing import List, Sequence, Tuple

__all__ = ["MIN_COPY_BYTES", "copy_runs", "layer_groups"]

MIN_COPY_BYTES = 256 << 10
"""Below this a host-to-device copy is dominated by its fixed cost (issue + DMA start)."""


def layer_groups(num_layers: int, layer_bytes: int,
                 min_copy_bytes: int = MIN_COPY_BYTES) -> List[range]:
    """Consecutive layers copied together: ranges covering 0..num_layers-1 in
    order, each the fewest layers whose bytes reach min_copy_bytes (the last
    may hold fewer)."""
    if num_layers <= 0 or layer_bytes <= 0:
        raise ValueError(f"num_layers and layer_bytes must be positive, got {num_layers}, "
                         f"{layer_bytes}")
    per = max(1, -(-max(0, min_copy_bytes) // layer_bytes))
    return [range(i, min(i + per, num_layers)) for i in range(0, num_layers, per)]


def copy_runs(addresses: Sequence[int], block_bytes: int) -> List[Tuple[int, int]]:
    """(first, count) runs of blocks whose host bytes follow each other
    (addresses[j + 1] == addresses[j] + block_bytes), in order, covering
    every block once: one copy per run when whole blocks are copied."""
    runs: List[Tuple[int, int]] = []
    for j, a in enumerate(addresses):
        if runs:
            first, count = runs[-1]
            if a == addresses[first] + count * block_bytes:
                runs[-1] = (first, count + 1)
                continue
        runs.append((j, 1))
    return runs
