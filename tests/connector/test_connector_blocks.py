"""KV layout -> namespace, and block bytes <-> paged KV tensors (torch, no engine)."""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (it comes with vllm)")

from kvkeeper.client.checksum import checksum  # noqa: E402
from kvkeeper.connector.blocks import BlockCodec, LayoutMismatch  # noqa: E402
from kvkeeper.connector.layout import (KVLayout, UnsupportedLayout, layout_from_config,  # noqa: E402
                                       namespace_descriptor)
from kvkeeper.v1 import kvkeeper_pb2 as pb  # noqa: E402


class FullAttentionSpec(SimpleNamespace):
    """Stands in for vLLM's spec: only the attributes layout.py reads."""


def make_configs(*, layers: int = 2, heads: int = 2, block: int = 32, head_size: int = 32,
                 dtype=torch.float32, cache_dtype: str = "auto", groups: int = 1,
                 layout: str = "LBHNC", tp: int = 1, pp: int = 1):
    elem = torch.empty((), dtype=dtype).element_size()
    spec = FullAttentionSpec(num_heads=heads, block_size=block, dtype=dtype, tokens_per_state=1,
                             state_content_size_bytes=2 * head_size * elem)
    names = [f"model.layers.{i}.self_attn.attn" for i in range(layers)]
    group = SimpleNamespace(layer_names=names, kv_cache_spec=spec, enable_kv_transfer=True)
    kvc = SimpleNamespace(num_blocks=16, kv_cache_groups=[group] * groups, kv_cache_layout=layout)
    vc = SimpleNamespace(
        model_config=SimpleNamespace(model="org/model", revision=None, quantization=None),
        cache_config=SimpleNamespace(block_size=block, cache_dtype=cache_dtype,
                                     kv_cache_layout=layout),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp,
                                        decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1))
    return vc, kvc


def kv_tensors(layout: KVLayout, num_blocks: int, *, split: int = 1, permute: bool = False,
               dtype=torch.float32, seed: int = 0) -> Dict[str, torch.Tensor]:
    """Per-layer logical [B*split, H, N/split, C] views over one storage, filled
    with distinct values; permute=True gives them LBNHC-like strides."""
    g = torch.Generator().manual_seed(seed)
    elem = torch.empty((), dtype=dtype).element_size()
    c = layout.content_bytes // elem
    h, n = layout.num_heads, layout.block_tokens // split
    b = num_blocks * split
    out = {}
    for name in layout.layer_names:
        if permute:  # physical [B, N, H, C], logical view [B, H, N, C]
            base = torch.randn(b, n, h, c, generator=g).to(dtype)
            out[name] = base.permute(0, 2, 1, 3)
        else:
            out[name] = torch.randn(b, h, n, c, generator=g).to(dtype)
    return out


LAYOUT = KVLayout(layer_names=("l0", "l1", "l2"), num_heads=2, block_tokens=32,
                  content_bytes=64 * 4, dtype="float32", physical="LBHNC",
                  spec_kind="FullAttentionSpec")


def test_layout_and_namespace_from_config() -> None:
    vc, kvc = make_configs()
    lay = layout_from_config(vc, kvc)
    assert lay.block_tokens == 32 and lay.num_heads == 2 and lay.content_bytes == 256
    assert lay.block_bytes == 2 * (2 * 32 * 256)
    ns = namespace_descriptor(vc, lay, tp_rank=0, tp_size=1)
    assert ns == {"model_id": "org/model", "model_revision": "", "dtype": "float32",
                  "kv_layout": "kvk1:LBHNC:FullAttentionSpec:L2xH2xN32xC256B",
                  "block_tokens": 32, "block_bytes": 32768, "tp_rank": 0, "tp_size": 1}
    # the scheduler and a worker derive the same thing from the same configs
    assert namespace_descriptor(*make_configs()[:1], layout_from_config(*make_configs()),
                                tp_rank=0, tp_size=1) == ns
    # quantised caches and overrides show up
    vc8, kvc8 = make_configs(dtype=torch.uint8, cache_dtype="fp8_e4m3")
    assert layout_from_config(vc8, kvc8).dtype == "uint8/fp8_e4m3"
    assert namespace_descriptor(vc, lay, tp_rank=1, tp_size=2, model_id="m",
                                model_revision="r")["model_id"] == "m"


@pytest.mark.parametrize("kw,why", [
    ({"groups": 2}, "KV cache groups"),
    ({"pp": 2}, "pipeline"),
])
def test_unsupported_layouts_say_why(kw: dict, why: str) -> None:
    vc, kvc = make_configs(**kw)
    with pytest.raises(UnsupportedLayout, match=why):
        layout_from_config(vc, kvc)


def test_unsupported_spec() -> None:
    vc, kvc = make_configs()
    kvc.kv_cache_groups[0].kv_cache_spec = SimpleNamespace(block_size=32)  # e.g. a mamba state
    with pytest.raises(UnsupportedLayout, match="attention"):
        layout_from_config(vc, kvc)


@pytest.mark.parametrize("split", [1, 2, 4])
@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gather_scatter_round_trip(split: int, permute: bool, dtype) -> None:
    elem = torch.empty((), dtype=dtype).element_size()
    lay = KVLayout(layer_names=("l0", "l1", "l2"), num_heads=2, block_tokens=32,
                   content_bytes=64 * elem, dtype=str(dtype).replace("torch.", ""),
                   physical="LBHNC", spec_kind="FullAttentionSpec")
    src = kv_tensors(lay, 10, split=split, permute=permute, dtype=dtype, seed=1)
    dst = kv_tensors(lay, 10, split=split, permute=permute, dtype=dtype, seed=2)
    a, b = BlockCodec(lay, src, 10), BlockCodec(lay, dst, 10)
    ids_src, ids_dst = [7, 2, 5], [0, 9, 3]
    rows = a.new_rows(3)
    a.gather(ids_src, rows)
    untouched = {k: v.clone() for k, v in dst.items()}
    b.scatter(ids_dst, rows)
    for name in lay.layer_names:
        for s, d in zip(ids_src, ids_dst):
            for j in range(split):
                assert torch.equal(dst[name][d * split + j], src[name][s * split + j])
        others = [i for i in range(10) if i not in ids_dst]
        for o in others:  # nothing else was written
            for j in range(split):
                assert torch.equal(dst[name][o * split + j], untouched[name][o * split + j])
    again = b.new_rows(3)
    b.gather(ids_dst, again)
    assert torch.equal(rows, again)


@pytest.mark.parametrize("algo", [pb.CHECKSUM_CRC32, pb.CHECKSUM_XXH3_64])
@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_block_checksum_is_the_checksum_of_the_block_bytes(algo: int, split: int, permute: bool,
                                                            dtype) -> None:
    """Computed from the KV tensors layer by layer (CRC32 chained, XXH3 streamed):
    the value a client computes over the whole block's bytes at save."""
    elem = torch.empty((), dtype=dtype).element_size()
    lay = KVLayout(layer_names=("l0", "l1", "l2"), num_heads=2, block_tokens=32,
                   content_bytes=64 * elem, dtype=str(dtype).replace("torch.", ""),
                   physical="LBHNC", spec_kind="FullAttentionSpec")
    codec = BlockCodec(lay, kv_tensors(lay, 6, split=split, permute=permute, dtype=dtype), 6)
    rows = codec.new_rows(6)
    codec.gather(list(range(6)), rows)
    sums = [checksum(algo, rows[i].numpy()) for i in range(6)]
    assert len(set(sums)) == 6
    assert [codec.block_checksum(i, algo) for i in range(6)] == sums
    with pytest.raises(KeyError):
        codec.block_checksum(0, pb.CHECKSUM_NONE)


def test_block_bytes_are_layers_in_order_each_in_logical_hnc_order() -> None:
    src = kv_tensors(LAYOUT, 4, permute=True)
    codec = BlockCodec(LAYOUT, src, 4)
    rows = codec.new_rows(1)
    codec.gather([3], rows)
    want = b"".join(src[n][3].contiguous().numpy().tobytes() for n in LAYOUT.layer_names)
    assert rows[0].numpy().tobytes() == want


def test_split_kernel_blocks_serialise_like_whole_blocks() -> None:
    """A block split into 2 kernel blocks of 16 tokens has the same bytes as one
    block of 32: the format does not depend on the kernel block size."""
    whole = kv_tensors(LAYOUT, 4, split=1)
    halves = {}
    for name, t in whole.items():  # [B, H, 32, C] -> [2B, H, 16, C]
        b, h, n, c = t.shape
        halves[name] = t.view(b, h, 2, n // 2, c).permute(0, 2, 1, 3, 4).reshape(2 * b, h, n // 2, c)
    r1, r2 = BlockCodec(LAYOUT, whole, 4).new_rows(2), BlockCodec(LAYOUT, halves, 4).new_rows(2)
    BlockCodec(LAYOUT, whole, 4).gather([1, 3], r1)
    BlockCodec(LAYOUT, halves, 4).gather([1, 3], r2)
    assert torch.equal(r1, r2)


@pytest.mark.parametrize("mutate,why", [
    (lambda t: {k: v[:, :1] for k, v in t.items()}, "head slots"),
    (lambda t: {k: v.to(torch.float64) for k, v in t.items()}, "content bytes"),
    (lambda t: {k: v for k, v in list(t.items())[:2]}, "no KV tensor"),
    (lambda t: dict(t, extra=next(iter(t.values()))), "not in the KV cache group"),
    (lambda t: {k: v[:3] for k, v in t.items()}, "multiple"),
    (lambda t: {k: v.reshape(v.shape[0], -1) for k, v in t.items()}, "4-d"),
])
def test_mismatching_tensors_are_refused(mutate, why: str) -> None:
    with pytest.raises(LayoutMismatch, match=why):
        BlockCodec(LAYOUT, mutate(kv_tensors(LAYOUT, 4)), 4)


def test_rows_are_checked() -> None:
    codec = BlockCodec(LAYOUT, kv_tensors(LAYOUT, 4), 4)
    with pytest.raises(ValueError):
        codec.gather([0, 1], codec.new_rows(1))
    with pytest.raises(ValueError):
        codec.scatter([0], torch.zeros((1, 10), dtype=torch.uint8))


@pytest.mark.parametrize("split", [1, 2])
@pytest.mark.parametrize("permute", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_direct_copies_in_write_what_scatter_writes(split: int, permute: bool, dtype) -> None:
    """copy_layer_in and copy_block_in (memmove where a block's layer is one
    span of host memory: split 1, not permuted) put the block bytes where
    scatter does, and nothing anywhere else."""
    elem = torch.empty((), dtype=dtype).element_size()
    lay = KVLayout(layer_names=("l0", "l1", "l2"), num_heads=2, block_tokens=32,
                   content_bytes=64 * elem, dtype=str(dtype).replace("torch.", ""),
                   physical="LBHNC", spec_kind="FullAttentionSpec")
    src = BlockCodec(lay, kv_tensors(lay, 6, split=split, permute=permute, dtype=dtype, seed=1), 6)
    rows = src.new_rows(3)
    src.gather([4, 0, 5], rows)
    sources = [rows[i] for i in range(3)]   # each a whole block's bytes
    want = kv_tensors(lay, 6, split=split, permute=permute, dtype=dtype, seed=2)
    BlockCodec(lay, want, 6).scatter([1, 5, 2], rows)
    by_layer = kv_tensors(lay, 6, split=split, permute=permute, dtype=dtype, seed=2)
    codec = BlockCodec(lay, by_layer, 6)
    for i in range(codec.num_layers):
        codec.copy_layer_in(i, [1, 5, 2], sources)
    by_block = kv_tensors(lay, 6, split=split, permute=permute, dtype=dtype, seed=2)
    codec = BlockCodec(lay, by_block, 6)
    for bid, s in zip([1, 5, 2], sources):
        codec.copy_block_in(bid, s)
    for name in lay.layer_names:
        assert torch.equal(by_layer[name], want[name]) and torch.equal(by_block[name], want[name])


def test_direct_copies_refuse_what_would_write_outside_the_kv_cache() -> None:
    kv = kv_tensors(LAYOUT, 4)
    before = {k: v.clone() for k, v in kv.items()}
    codec = BlockCodec(LAYOUT, kv, 4)
    block = torch.zeros(codec.block_bytes, dtype=torch.uint8)
    for bad in (4, -1, 100):
        with pytest.raises(IndexError, match="outside"):
            codec.copy_block_in(bad, block)
        with pytest.raises(IndexError, match="outside"):
            codec.copy_layer_in(1, [bad], [block])
    with pytest.raises(ValueError, match="contiguous host bytes"):
        codec.copy_block_in(0, block[:-1])             # short
    with pytest.raises(ValueError, match="contiguous host bytes"):
        codec.copy_block_in(0, torch.zeros(codec.block_bytes // 4))   # not bytes
    with pytest.raises(ValueError, match="contiguous host bytes"):
        codec.copy_layer_in(0, [0], [torch.zeros(2 * codec.block_bytes, dtype=torch.uint8)[::2]])
    for k in kv:
        assert torch.equal(kv[k], before[k])
