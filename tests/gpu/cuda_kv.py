"""Helpers of the CUDA tests: an arena-like file mapping, a paged KV cache on the GPU."""
from __future__ import annotations

import mmap
import os
import tempfile

import torch

from kvkeeper.client.arena_mapping import ArenaMapping, file_id
from kvkeeper.client.checksum import xxh3_64
from kvkeeper.connector.blocks import BlockCodec
from kvkeeper.connector.layout import KVLayout
from kvkeeper.v1 import kvkeeper_pb2 as pb

PAGE = 4096
DEV = torch.device("cuda", 0) if torch.cuda.is_available() else None


def arena(nbytes: int) -> ArenaMapping:
    where = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(prefix="kvk-gpu-test-", dir=where)
    try:
        os.ftruncate(fd, PAGE + nbytes)
        mm = mmap.mmap(fd, PAGE + nbytes, flags=mmap.MAP_SHARED)
        return ArenaMapping(path, PAGE + nbytes, b"g" * 16, PAGE, nbytes // PAGE, PAGE,
                            file_id(os.fstat(fd)), mm)
    finally:
        os.close(fd)
        os.unlink(path)


def cuda_codec(layers: int = 4, num_blocks: int = 16, split: int = 1, permute: bool = False,
               heads: int = 8, tokens: int = 32, head: int = 64):
    layout = KVLayout(layer_names=tuple(f"l{i}" for i in range(layers)), num_heads=heads,
                      block_tokens=tokens, content_bytes=head * 4, dtype="float32",
                      physical="test", spec_kind="FullAttentionSpec")
    kv = {}
    for n in layout.layer_names:
        if permute:   # physical [B, N, H, C] (flash-attention-like), logical [B, H, N, C]
            kv[n] = torch.zeros(num_blocks * split, tokens // split, heads, head,
                                device=DEV).permute(0, 2, 1, 3)
        else:
            kv[n] = torch.zeros(num_blocks * split, heads, tokens // split, head, device=DEV)
    return BlockCodec(layout, kv, num_blocks), kv


def fill(m: ArenaMapping, codec: BlockCodec, slots):
    """Random blocks written at arena slots; (sources as views, their bytes, sums)."""
    bb = codec.block_bytes
    sources, data, sums = [], [], []
    for s in slots:
        b = os.urandom(bb)
        m.write([(PAGE + s * bb, bb)], b, whole=True)
        src = torch.frombuffer(m.view(PAGE + s * bb, bb), dtype=torch.uint8)
        sources.append(src)
        data.append(torch.frombuffer(bytearray(b), dtype=torch.uint8))
        sums.append((pb.CHECKSUM_XXH3_64, xxh3_64(b)))
    return sources, data, sums


def read_back(codec: BlockCodec, ids):
    rows = codec.new_rows(len(ids))
    torch.cuda.synchronize()
    codec.gather(ids, rows)   # the CPU path's gather: test-side only
    return rows
