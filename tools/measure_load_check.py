"""The connector's load check, measured: one full hit's copy into the KV cache
alone, and with each way of checking the copied blocks, side by side.

    PYTHONPATH=<shim> python tools/measure_load_check.py [--reps 21]

Needs torch (it comes with vLLM). The KV cache is issue 12's M2 model: 6
layers, 4 KV heads, head size 64, fp32, 32-token blocks (384 KiB), and the
hit is 2048 tokens (64 blocks, 25.2 MB) copied from a source array the size
of four hits (rotated, so no kind reads cache-hot bytes another just wrote).
Kinds alternate order every repetition; medians are printed. What
copy_in.py's choice rests on: the check of the source right after the copy
(BlockLoader.block_ok with the source) against reading the copy back out of
the KV cache piece by piece (block_ok without one), for CRC32 and XXH3-64;
the copy as copy_layer_in does it (one memmove per block and layer) against
a torch copy_ per block slice (what it did before); and copy_check_in, each
block copied then hashed while its source is in the cache.
Not a test: the figures depend on the machine and its load.
"""
from __future__ import annotations

import argparse
import time
from statistics import median

import numpy as np
import torch

from kvkeeper.client.checksum import checksum
from kvkeeper.connector.blocks import BlockCodec
from kvkeeper.connector.layout import KVLayout
from kvkeeper.connector.load.copy_in import BlockLoader
from kvkeeper.connector.load.step import FetchedLoad
from kvkeeper.connector.metadata import LoadSpec
from kvkeeper.connector.stats import Counters
from kvkeeper.v1 import kvkeeper_pb2 as pb

LAYERS, HEADS, TOKENS, HEAD_SIZE, HIT_BLOCKS, KV_BLOCKS = 6, 4, 32, 64, 64, 256


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--reps", type=int, default=21)
    reps = p.parse_args().reps
    lay = KVLayout(layer_names=tuple(f"l{i}" for i in range(LAYERS)), num_heads=HEADS,
                   block_tokens=TOKENS, content_bytes=2 * HEAD_SIZE * 4, dtype="float32",
                   physical="LBHNC", spec_kind="FullAttentionSpec")
    kv = {n: torch.zeros(KV_BLOCKS, HEADS, TOKENS, 2 * HEAD_SIZE) for n in lay.layer_names}
    codec = BlockCodec(lay, kv, KV_BLOCKS)
    loader = BlockLoader(codec, True, Counters(), None)
    bb = lay.block_bytes
    src = torch.from_numpy(np.random.default_rng(0).integers(
        0, 256, (4 * HIT_BLOCKS, bb), dtype=np.uint8))
    ids = list(range(100, 100 + HIT_BLOCKS))

    def torch_copy(layer: int, sources: list) -> None:
        # copy_layer_in before its memmove path: a torch copy_ per block slice
        t = kv[lay.layer_names[layer]]
        lb = lay.layer_bytes
        for bid, s in zip(ids, sources):
            t[bid:bid + 1].copy_(s[layer * lb:(layer + 1) * lb].view(t.dtype).view(1, *t.shape[1:]))

    def run(kind: str, algo: int, first: int) -> float:
        sources = [src[first + i] for i in range(HIT_BLOCKS)]
        sums = [(algo, checksum(algo, s.numpy())) if algo else (0, 0) for s in sources]
        if kind == "block at a time":
            f = FetchedLoad(LoadSpec(req_id="r", keys=((),), block_ids=tuple(ids), load_id=1),
                            None, HIT_BLOCKS, sources, sums)
            t0 = time.perf_counter()
            bad = loader.copy_check_in(f, 0, HIT_BLOCKS)
            t = time.perf_counter() - t0
            assert not bad
            return t
        t0 = time.perf_counter()
        for layer in range(codec.num_layers):
            if kind.startswith("torch"):
                torch_copy(layer, sources)
            else:
                codec.copy_layer_in(layer, ids, sources)
        if kind.endswith("source"):
            ok = [loader.block_ok(b, s, x) for b, s, x in zip(ids, sums, sources)]
        elif kind == "kv cache":
            ok = [loader.block_ok(b, s) for b, s in zip(ids, sums)]
        else:
            ok = [True]
        t = time.perf_counter() - t0
        assert all(ok)
        return t

    kinds = [("copy only", 0), ("torch copy only", 0), ("kv cache", pb.CHECKSUM_CRC32),
             ("source", pb.CHECKSUM_CRC32), ("kv cache", pb.CHECKSUM_XXH3_64),
             ("source", pb.CHECKSUM_XXH3_64), ("torch copy_, source", pb.CHECKSUM_XXH3_64),
             ("block at a time", pb.CHECKSUM_XXH3_64)]
    times: dict = {k: [] for k in kinds}
    for r in range(reps + 1):   # r 0: warm-up
        order = kinds if r % 2 else kinds[::-1]
        for j, k in enumerate(order):
            t = run(k[0], k[1], ((r * len(kinds) + j) % 4) * HIT_BLOCKS)
            if r:
                times[k].append(t)
    total = HIT_BLOCKS * bb
    print(f"{HIT_BLOCKS} blocks of {bb} B = {total / 1e6:.1f} MB; medians of {reps}")
    for (kind, algo), ts in times.items():
        name = pb.ChecksumAlgo.Name(algo) if algo else ""
        what = (kind if not algo else f"copy_check_in, {name} (block at a time)"
                if kind == "block at a time" else f"{kind.split(',')[0]} + {name} of the source"
                if kind.startswith("torch") else f"copy + {name} of the {kind}")
        print(f"  {what:<48} {median(ts) * 1e3:6.1f} ms  {total / median(ts) / 1e9:5.2f} GB/s")


if __name__ == "__main__":
    main()
