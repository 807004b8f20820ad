"""LoadTimings: where the worker's last step of loads spent its time.

An observation point, not a control: the worker fills one record per step
that loads (WorkerSide.load_timings, replaced at each start_load_kv) and
nothing in the connector reads it back. Benchmarks and debugging read it
after the step's loads are settled (after get_block_ids_with_load_errors);
read earlier, phases that run beside the forward may be missing.
"""
from __future__ import annotations

from dataclasses import dataclass, fields
from typing import Dict, Optional

__all__ = ["LoadTimings"]


@dataclass
class LoadTimings:
    """Seconds per phase; None for a phase the step did not go through
    (which phases run depends on the load strategy and the transport)."""

    fetch: Optional[float] = None          # Match (or the scheduler's refs) and arena views
    copy: Optional[float] = None           # arena -> KV cache, every fetched block
    check: Optional[float] = None          # checksums of the copied blocks
    stream: Optional[float] = None         # streamed loads, whole (no mapped arena)
    stream_first: Optional[float] = None   # of which: until the first chunk came
    stream_copy: Optional[float] = None    # of which: copying and checking chunks
    layer_wait: Optional[float] = None     # wait_for_layer_load, summed over the layers
    check_wait: Optional[float] = None     # after the forward, for copies and checks beside it
    copy_out_wait: Optional[float] = None  # copying queued saves out before vLLM frees blocks

    def add(self, phase: str, seconds: float) -> None:
        """Add to a phase measured in several pieces (layer_wait)."""
        setattr(self, phase, (getattr(self, phase) or 0.0) + seconds)

    def as_dict(self) -> Dict[str, float]:
        """The phases measured, by name."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}
