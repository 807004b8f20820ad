"""Peer handles for a KV cache on a GPU: CUDA IPC, as torch.multiprocessing makes them.

Written for CUDA, run only by tests/gpu (no GPU here); the connector does
not use it yet: the daemon's peer socket carries file descriptors, and a
CUDA KV cache is not one (PeerUnsupported in share.py).

A holder exports each layer's KV tensor as a handle (export_kv:
UntypedStorage._share_cuda_, a cudaIpcMemHandle of the caching allocator's
block holding the storage, plus torch's producer-side reference counter
and event) that any process on the same GPU opens (import_kv:
UntypedStorage._new_shared_cuda, cudaIpcOpenMemHandle). The handle is
plain bytes (hex in the dict), so it can travel in a JSON message. The
holder's generations live in host shared memory as for the CPU build
(gens.py): copy_blocks checks them before it enqueues the device-to-device
copies and after they completed (a stream synchronize), so a block the
holder reused meanwhile is never used, exactly as on the host.

A holder that dies: its allocations stay alive while another process has
them open (CUDA keeps an IPC-opened allocation until every importer closed
it), so a copy in flight completes, and the dead holder's generations no
longer move. Torch's producer, however, frees a shared block only once the
consumers released their reference counter, so a peer must drop its
imported tensors (close) when done with a holder.
"""
from __future__ import annotations

from typing import Any, Callable, Dict, Optional, Sequence

import torch

from .gens import Generations, first_changed

__all__ = ["copy_blocks", "export_kv", "import_kv"]


def _dtype(name: str) -> torch.dtype:
    dt = getattr(torch, name.replace("torch.", ""), None)
    if not isinstance(dt, torch.dtype):
        raise ValueError(f"unknown dtype {name!r}")
    return dt


def export_kv(tensor: torch.Tensor) -> Dict[str, Any]:
    """A handle another process on this GPU opens with import_kv."""
    if tensor.device.type != "cuda":
        raise ValueError(f"a CUDA IPC handle needs a CUDA tensor, got {tensor.device}")
    (device, handle, size, offset, ref_handle, ref_offset, event,
     event_sync) = tensor.untyped_storage()._share_cuda_()
    return {"device": int(device), "handle": bytes(handle).hex(), "size": int(size),
            "offset": int(offset), "ref_handle": bytes(ref_handle).hex(),
            "ref_offset": int(ref_offset), "event": bytes(event or b"").hex(),
            "event_sync": bool(event_sync), "shape": list(tensor.shape),
            "stride": list(tensor.stride()), "storage_offset": int(tensor.storage_offset()),
            "dtype": str(tensor.dtype)}


def import_kv(h: Dict[str, Any]) -> torch.Tensor:
    """The holder's tensor, opened from its handle (same GPU, another process)."""
    torch.cuda._lazy_init()
    storage = torch.UntypedStorage._new_shared_cuda(
        h["device"], bytes.fromhex(h["handle"]), h["size"], h["offset"],
        bytes.fromhex(h["ref_handle"]), h["ref_offset"], bytes.fromhex(h["event"]) or None,
        h["event_sync"])
    t = torch.empty(0, dtype=_dtype(h["dtype"]), device=f"cuda:{h['device']}")
    t.set_(storage, h["storage_offset"], tuple(h["shape"]), tuple(h["stride"]))
    return t


def copy_blocks(src_layers: Sequence[torch.Tensor], dst_layers: Sequence[torch.Tensor],
                holder_blocks: Sequence[int], block_ids: Sequence[int], gens: Generations,
                expected: Sequence[int], stream: Any = None,
                after_copy: Optional[Callable[[], None]] = None) -> int:
    """Copy holder_blocks[i] of every layer into block_ids[i] of ours, checked
    by the holder's generations before and after; the leading intact blocks.
    after_copy (tests): called once the copies are enqueued, before the wait."""
    if not gens.attached:
        return 0
    k = first_changed(gens.read(holder_blocks), expected)
    if k == 0:
        return 0
    stream = stream or torch.cuda.current_stream()
    src_idx = torch.as_tensor(list(holder_blocks[:k]), dtype=torch.long)
    dst_idx = torch.as_tensor(list(block_ids[:k]), dtype=torch.long)
    with torch.cuda.stream(stream):
        for src, dst in zip(src_layers, dst_layers):
            s, d = src_idx.to(src.device, non_blocking=True), dst_idx.to(dst.device,
                                                                          non_blocking=True)
            dst.index_copy_(0, d, src.index_select(0, s))
    if after_copy is not None:
        after_copy()
    stream.synchronize()   # every byte is read before the second check
    return first_changed(gens.read(holder_blocks[:k]), expected[:k])
