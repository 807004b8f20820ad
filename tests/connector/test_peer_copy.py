"""Same-host peers without an engine: the KV storage moved into shared memory
(every view follows), generations checked around a copy, and a holder's
blocks copied into another cache through its read-only mapping."""
from __future__ import annotations

import mmap
import os
from typing import Dict, List

import numpy as np
import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (it comes with vllm)")

from kvkeeper.client.peer_segment import check_descriptor, gens_bytes  # noqa: E402
from kvkeeper.connector.blocks import BlockCodec  # noqa: E402
from kvkeeper.connector.layout import KVLayout  # noqa: E402
from kvkeeper.connector.peer.gens import Generations, copy_checked, first_changed  # noqa: E402
from kvkeeper.connector.peer.share import descriptor, share_kv_storage  # noqa: E402
from kvkeeper.connector.peer.source import HolderMap  # noqa: E402

LAYOUT = KVLayout(layer_names=("l0", "l1"), num_heads=2, block_tokens=32, content_bytes=64,
                  dtype="float32", physical="LBHNC", spec_kind="FullAttentionSpec")


def vllm_like_cache(num_blocks: int, seed: int) -> Dict[str, torch.Tensor]:
    """As vLLM's CPU worker allocates it: one int8 buffer, per-layer float views."""
    lb = LAYOUT.layer_bytes
    buf = torch.zeros(num_blocks * LAYOUT.block_bytes, dtype=torch.int8)
    g = torch.Generator().manual_seed(seed)
    out = {}
    for i, name in enumerate(LAYOUT.layer_names):
        part = buf[i * num_blocks * lb:(i + 1) * num_blocks * lb].view(torch.float32)
        view = part.view(num_blocks, LAYOUT.num_heads, LAYOUT.block_tokens, 16)
        view.copy_(torch.randn(view.shape, generator=g))
        out[name] = view
    return out


def test_sharing_moves_the_storage_under_every_view() -> None:
    kv = vllm_like_cache(8, seed=1)
    other_view = kv["l1"][3]          # a view vLLM's attention layer might keep
    before = kv["l1"].clone()
    shared = share_kv_storage(kv, LAYOUT.layer_names)
    try:
        assert kv["l0"].untyped_storage().is_shared()
        assert torch.equal(kv["l1"], before)          # the bytes came along
        other_view.fill_(7.0)                         # written through the old view...
        with mmap.mmap(shared.fd, shared.nbytes, prot=mmap.PROT_READ) as m:   # ...seen in shm
            arr = np.frombuffer(m, dtype=np.float32)
            off = (kv["l1"][3].data_ptr() - shared.base) // 4
            assert (arr[off:off + 16] == 7.0).all()
            del arr
        with pytest.raises(PermissionError):          # peers get a read-only descriptor
            mmap.mmap(shared.fd, shared.nbytes, prot=mmap.PROT_READ | mmap.PROT_WRITE)
    finally:
        shared.close()


def test_generations_checked_before_and_after_the_copy(tmp_path) -> None:
    gens, fd = Generations.open_named(str(tmp_path / "g"), 8)
    os.close(fd)
    copied: List[int] = []
    assert copy_checked(gens, [1, 2, 3], [0, 0, 0], copied.append) == 0   # not attached
    gens.attach()
    assert copy_checked(gens, [1, 2, 3], [0, 0, 0], copied.append) == 3 and copied == [3]
    gens.bump([2])                      # reused before the copy: only what precedes it
    assert copy_checked(gens, [1, 2, 3], [0, 0, 0], copied.append) == 1 and copied[-1] == 1
    gens.bump([2])
    assert first_changed(gens.read([1, 2, 3]), [0, 2, 0]) == 3

    def reuse_mid_copy(k: int) -> None:   # the holder reuses block 3 while it is copied
        copied.append(k)
        gens.bump([3])

    assert copy_checked(gens, [1, 2, 3, 4], [0, 2, 0, 0], reuse_mid_copy) == 2
    assert copied[-1] == 4
    gens.detach()
    assert copy_checked(gens, [1], [0], copied.append) == 0
    gens.close()


def test_a_holders_blocks_copied_into_a_peers_cache(tmp_path) -> None:
    holder_kv = vllm_like_cache(8, seed=2)
    shared = share_kv_storage(holder_kv, LAYOUT.layer_names)
    holder = BlockCodec(LAYOUT, holder_kv, 8)
    desc = descriptor(shared, holder.flat_spans(), 8, LAYOUT.block_bytes, LAYOUT.layer_bytes)
    gens, gfd = Generations.open_named(str(tmp_path / "g"), 8)
    gens.attach()
    assert check_descriptor(desc, shared.nbytes, gens_bytes(8)) == []
    peer_kv = vllm_like_cache(6, seed=3)
    peer = BlockCodec(LAYOUT, peer_kv, 6)
    m = HolderMap(desc, shared.fd, gfd)
    try:
        layers: List[int] = []
        got = copy_checked(m.gens, [5, 2], [0, 0],
                           lambda k: m.copy_into(peer, [1, 4][:k], [5, 2][:k], layers.append))
        assert got == 2 and layers == [0, 1]
        for name in LAYOUT.layer_names:
            assert torch.equal(peer_kv[name][1], holder_kv[name][5])
            assert torch.equal(peer_kv[name][4], holder_kv[name][2])
        with pytest.raises(IndexError):
            m.copy_into(peer, [0], [8], layers.append)   # outside the holder's cache
        with pytest.raises(IndexError):
            m.copy_into(peer, [6], [0], layers.append)   # outside ours
        bad = dict(desc, layers=[[0, LAYOUT.layer_bytes], [shared.nbytes, LAYOUT.layer_bytes]])
        with pytest.raises(ValueError, match="past the segment"):
            HolderMap(bad, shared.fd, gfd)
    finally:
        m.close()
        gens.close()
        os.close(gfd)
        shared.close()
