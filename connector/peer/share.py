"""The holder's KV cache moved into shared memory, and the segment descriptor of it.

vLLM's CPU worker allocates the whole KV cache as one tensor and hands
the connector per-layer views of it (vllm.v1.worker.utils.allocate_kv_cache),
and the attention layers hold views of their own. Re-pointing the tensors
the connector sees would leave those others on the old memory, so the
storage itself moves: torch's UntypedStorage._share_fd_cpu_ (what
share_memory_ does under torch.multiprocessing's default strategy) copies
the bytes into an unlinked POSIX shared-memory object and swaps the
storage's data pointer in place, so every view of it, wherever vLLM keeps
one, reads and writes the shared pages from then on. It runs in
register_kv_caches, before any forward and before the connector's codec
reads the addresses. The descriptor handed out is read-only (a new open of
/proc/self/fd/N with O_RDONLY): a peer can map the cache, never write it.

Costs: the cache's size in /dev/shm (a full tmpfs kills its writer with
SIGBUS: size /dev/shm above VLLM_CPU_KVCACHE_SPACE) and one copy of the
cache at start-up.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Sequence

import torch

from kvkeeper.client.peer_segment import DESCRIPTOR_VERSION

__all__ = ["PeerUnsupported", "SharedKV", "descriptor", "share_kv_storage"]


class PeerUnsupported(ValueError):
    """This KV cache cannot be shared with peers (the reason says why)."""


@dataclass
class SharedKV:
    fd: int          # read-only descriptor of the shared-memory object (ours to close)
    nbytes: int
    base: int        # its address in this process

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def share_kv_storage(kv_caches: Mapping[str, torch.Tensor], layer_names: Sequence[str]
                     ) -> SharedKV:
    """Move the storage behind the layers' KV tensors into shared memory (in
    place: every view follows). PeerUnsupported when they are not one CPU
    storage."""
    tensors = [kv_caches.get(n) for n in layer_names]
    if not tensors or any(not isinstance(t, torch.Tensor) for t in tensors):
        raise PeerUnsupported("the KV cache is not one tensor per layer")
    if any(t.device.type != "cpu" for t in tensors):
        raise PeerUnsupported("the KV cache is not in host memory (CUDA: peer.cuda_ipc)")
    storage = tensors[0].untyped_storage()
    if any(t.untyped_storage().data_ptr() != storage.data_ptr() for t in tensors):
        raise PeerUnsupported("the layers' KV tensors are not views of one allocation")
    fd, nbytes = storage._share_fd_cpu_()
    ro = os.open(f"/proc/self/fd/{int(fd)}", os.O_RDONLY | os.O_CLOEXEC)
    return SharedKV(ro, int(nbytes), storage.data_ptr())


def descriptor(shared: SharedKV, spans: Sequence[Any], num_blocks: int, block_bytes: int,
               layer_bytes: int) -> Dict[str, Any]:
    """The segment descriptor (client/peer_segment.py) of `shared`, whose
    layers lie at spans[i] = (address, bytes per block, blocks, offset in a
    block) (BlockCodec.flat_spans)."""
    layers = []
    for addr, stride, n, _ in spans:
        if n != num_blocks:
            raise PeerUnsupported(f"a layer has {n} kernel blocks for {num_blocks} blocks")
        off = addr - shared.base
        if off < 0 or off + (n - 1) * stride + layer_bytes > shared.nbytes:
            raise PeerUnsupported("a layer lies outside the shared storage")
        layers.append([int(off), int(stride)])
    return {"version": DESCRIPTOR_VERSION, "num_blocks": int(num_blocks),
            "block_bytes": int(block_bytes), "layer_bytes": int(layer_bytes),
            "kv_bytes": int(shared.nbytes), "layers": layers}
