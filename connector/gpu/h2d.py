"""DeviceLoader: verified host blocks copied into a paged KV cache on a GPU.

Order of work for one step (load_checked):
1. every block is checked on the host, over the arena bytes it is about to be
   copied from (xxh3 at memory speed); nothing is read back from the device.
   Only the leading good blocks are copied: a bad block and every one after
   it are recomputed by vLLM anyway, so corrupt bytes never reach the GPU;
2. on the side stream, after an event of the compute stream (so no earlier
   work on those KV blocks is overtaken), each layer group (plan.py) of every
   block is copied host-to-device into a staging tensor (from the pinned
   arena: asynchronous DMA), then scattered into the layers' KV tensors on
   the device (the kernels' block layout, split kernel blocks), and the
   group's event is recorded: its layers' LayerSignals are armed with it;
3. the last event says when all of it is done: only then may the leases be
   released (the DMA reads the arena until then).
The host thread issuing this never waits for the device.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import torch

from kvkeeper.client.checksum import can_verify, checksum
from kvkeeper.client.pinned import PinnedArena
from kvkeeper.v1 import kvkeeper_pb2 as pb

from ..blocks import BlockCodec
from .plan import MIN_COPY_BYTES, copy_runs, layer_groups
from .signals import LayerSignal

__all__ = ["DeviceLoader", "device_kernel_ids", "host_block_ok"]


def device_kernel_ids(codec: BlockCodec, ops: Any, block_ids: Sequence[int]) -> List[torch.Tensor]:
    """Per layer, the kernel block ids of block_ids on the device (one
    asynchronous copy per distinct set: usually one for all layers)."""
    out: List[torch.Tensor] = []
    seen: Dict[Tuple[int, ...], torch.Tensor] = {}
    for i in range(codec.num_layers):
        host = codec.kernel_ids(i, block_ids)
        key = tuple(host.tolist())
        if key not in seen:
            seen[key] = ops.to_device(host)
        out.append(seen[key])
    return out


def host_block_ok(source: torch.Tensor, expected: Tuple[int, int]) -> bool:
    """Whether a block's host bytes match (checksum_algo, checksum) as committed.
    Stored without a checksum: True; an algorithm this process lacks: False."""
    algo, want = expected
    if algo == pb.CHECKSUM_NONE:
        return True
    return can_verify(algo) and checksum(algo, source.numpy()) == want


class DeviceLoader:
    """Copies for one KV cache on a device, on `ops`' side stream."""

    def __init__(self, codec: BlockCodec, ops: Any, pinned: Optional[PinnedArena] = None,
                 min_copy_bytes: int = MIN_COPY_BYTES) -> None:
        self.codec = codec
        self.ops = ops
        self.pinned = pinned
        self.groups = layer_groups(codec.num_layers, codec.layout.layer_bytes, min_copy_bytes)

    def signals(self) -> Dict[str, LayerSignal]:
        """A fresh, not yet armed signal per layer, for StepLoads.layer_done."""
        return {name: LayerSignal(self.ops) for name in self.codec.layer_names}

    def load_checked(self, block_ids: Sequence[int], sources: Sequence[torch.Tensor],
                     ok: Callable[[int], bool],
                     signals: Optional[Dict[str, LayerSignal]] = None
                     ) -> Tuple[int, List[int], Optional[Any]]:
        """Check every block on the host with ok(j), then copy the leading good
        ones in. (good, bad positions, last event or None)."""
        bad = [j for j in range(len(sources)) if not ok(j)]
        good = bad[0] if bad else len(sources)
        return good, bad, self.copy(block_ids[:good], sources[:good], signals)

    def copy(self, block_ids: Sequence[int], sources: Sequence[torch.Tensor],
             signals: Optional[Dict[str, LayerSignal]] = None) -> Optional[Any]:
        """Issue the copies of sources[j] (uint8 host tensors of one block each,
        already checked) into vLLM block block_ids[j]; arm signals[layer] with
        its group's event (and set the others). The last event, or None when
        there is nothing to copy."""
        codec, ops = self.codec, self.ops
        if len(block_ids) != len(sources):
            raise ValueError(f"{len(block_ids)} block ids but {len(sources)} sources")
        names = codec.layer_names
        if not len(block_ids):
            for s in (signals or {}).values():
                s.set()
            return None
        bb, lb = codec.block_bytes, codec.layout.layer_bytes
        n = len(block_ids)
        whole = self._whole_runs(sources)
        before = ops.record(ops.current())   # the compute stream's work so far
        last = None
        with ops.on_side():
            ops.wait(ops.side, before)
            ids = device_kernel_ids(codec, ops, block_ids)
            staging = torch.empty((n, bb), dtype=torch.uint8, device=codec.device)
            for g in self.groups:
                lo, hi = g.start * lb, g.stop * lb
                if whole is not None and lo == 0 and hi == bb:
                    for j, k, span in whole:
                        staging[j:j + k].view(-1).copy_(span, non_blocking=True)
                else:
                    for j, src in enumerate(sources):
                        staging[j, lo:hi].copy_(src[lo:hi], non_blocking=True)
                for i in g:
                    codec.scatter_layer(i, ids[i], staging)
                last = ops.record(ops.side)
                if signals is not None:
                    for i in g:
                        signals[names[i]].arm(last)
        return last

    def _whole_runs(self, sources: Sequence[torch.Tensor]
                    ) -> Optional[List[Tuple[int, int, torch.Tensor]]]:
        """(first, count, host span) runs of sources adjacent in the pinned
        arena, for whole-block copies; None when they are not all in it."""
        pinned = self.pinned
        if pinned is None or pinned.mapping is None:
            return None
        bb = self.codec.block_bytes
        addrs = [s.data_ptr() for s in sources]
        if not all(s.numel() == bb and pinned.contains(a, bb) for s, a in zip(sources, addrs)):
            return None
        out = []
        for j, k in copy_runs(addrs, bb):
            span = sources[j] if k == 1 else torch.frombuffer(pinned.span(addrs[j], k * bb),
                                                              dtype=torch.uint8)
            out.append((j, k, span))
        return out
