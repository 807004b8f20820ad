"""DeviceSaves: blocks copied out of a KV cache on a GPU without stalling the forward.

wait_for_save runs on vLLM's thread right after the forward that computed the
blocks was issued on the compute stream; the save thread copies them out
later. So, per queued save:
- mark(), on vLLM's thread: an event recorded on the compute stream there,
  and that stream itself (SaveOrder);
- SaveOrder.copy_out(), on whichever thread copies first: the side stream
  waits for that event, gathers the blocks' layers from the KV tensors into
  device rows (the block byte order), records `gathered`, copies the rows
  device-to-host into pinned host rows and records `copied`. The compute
  stream is then made to wait for `gathered` (a device wait, the host goes
  on): any work issued on it afterwards, such as a forward that reuses the
  blocks once vLLM freed them, runs only after they were read;
- DeviceRows.host(), on the save thread: blocks that thread until `copied`
  completed and returns the host rows. The save's checksum is computed from
  them on the host (client.save) and the save committed only then.
"""
from __future__ import annotations

from typing import Any, Sequence

import torch

from ..blocks import BlockCodec
from .h2d import device_kernel_ids

__all__ = ["DeviceRows", "DeviceSaves", "SaveOrder"]


class DeviceRows:
    """Host rows being copied out of the device; host() once they are there."""

    __slots__ = ("_rows", "_ops", "copied", "gathered")

    def __init__(self, rows: torch.Tensor, ops: Any, gathered: Any, copied: Any) -> None:
        self._rows = rows
        self._ops = ops
        self.gathered = gathered
        self.copied = copied

    def host(self) -> torch.Tensor:
        """The rows, uint8 [n, block_bytes] on the host, after their D2H copy completed."""
        self._ops.synchronize(self.copied)
        return self._rows


class SaveOrder:
    """Where one queued save stands on the compute stream."""

    __slots__ = ("_ops", "event", "stream")

    def __init__(self, ops: Any, event: Any, stream: Any) -> None:
        self._ops = ops
        self.event = event     # recorded after the forward that computed the blocks
        self.stream = stream   # vLLM's compute stream (current when marked)

    def copy_out(self, codec: BlockCodec, block_ids: Sequence[int]) -> DeviceRows:
        ops = self._ops
        n = len(block_ids)
        with ops.on_side():
            ops.wait(ops.side, self.event)
            rows = torch.empty((n, codec.block_bytes), dtype=torch.uint8, device=codec.device)
            for i, ids in enumerate(device_kernel_ids(codec, ops, block_ids)):
                codec.gather_layer(i, ids, rows)
            gathered = ops.record(ops.side)
            out = codec.new_rows(n, pin=ops.pin)
            out.copy_(rows, non_blocking=True)
            copied = ops.record(ops.side)
        ops.wait(self.stream, gathered)
        return DeviceRows(out, ops, gathered, copied)


class DeviceSaves:
    """The save side of one KV cache on a device."""

    def __init__(self, ops: Any) -> None:
        self.ops = ops

    def mark(self) -> SaveOrder:
        """On vLLM's thread, when a save is queued after its forward was issued."""
        stream = self.ops.current()
        return SaveOrder(self.ops, self.ops.record(stream), stream)
