"""kvkeeper.connector.gpu: the copy path of a KV cache on a CUDA device.

Chosen only when vLLM's KV tensors are on CUDA; with them on the CPU nothing
here is used and no CUDA call is made. Modules:

  plan     which copies a set of blocks takes: layer groups, runs (pure Python)
  ops      the CUDA calls (side stream, events), one place; tests fake it
  signals  LayerSignal: wait_for_layer_load as a device-side stream wait
  h2d      DeviceLoader: blocks checked on the host, then copied in on the side stream
  d2h      DeviceSaves: blocks copied out on the side stream after the forward's event
  load     CudaLoad: the load strategy built from h2d (imports vLLM through load/)
  bench    `kvkeeper bench gpu`: pinned H2D / D2H of these paths against raw torch copies

The arena mapping is registered as pinned memory by
kvkeeper.client.pinned.PinnedArena.
"""
from __future__ import annotations

from typing import Any, Optional

__all__ = ["cuda_load_strategy", "device_saves_for", "on_cuda"]


def on_cuda(codec: Any) -> bool:
    """Whether a BlockCodec's KV tensors are on a CUDA device."""
    return getattr(getattr(codec, "device", None), "type", None) == "cuda"


def cuda_load_strategy(loader: Any, io: Any, link: Optional[Any]) -> Optional[Any]:
    """A CudaLoad for `loader` (a BlockLoader) when its KV cache is on CUDA, else None."""
    if not on_cuda(loader.codec):
        return None
    from kvkeeper.client.pinned import PinnedArena

    from .h2d import DeviceLoader
    from .load import CudaLoad
    from .ops import CudaOps

    device = DeviceLoader(loader.codec, CudaOps(loader.codec.device), PinnedArena())
    return CudaLoad(loader, io, device, link)


def device_saves_for(codec: Any) -> Optional[Any]:
    """A DeviceSaves for a BlockCodec whose KV cache is on CUDA, else None."""
    if not on_cuda(codec):
        return None
    from .d2h import DeviceSaves
    from .ops import CudaOps

    return DeviceSaves(CudaOps(codec.device))
