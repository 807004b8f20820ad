"""The KV layout of one TP rank and the namespace descriptor derived from it.

Scheduler and worker derive the same `KVLayout`s from the same inputs
(vllm_config + kv_cache_config), so they register the same namespaces
without talking to each other; the worker then checks its real KV tensors
against them (blocks.BlockCodec) before any byte is copied. Only what
changes the bytes of a block goes in:

* block_tokens: tokens per vLLM block (cache_config.block_size);
* per layer, the logical page [H, N, C] vLLM's attention backends index
  (H head slots, N = block_tokens, C content bytes per head and token);
* the layer names, in the KV cache group's order (the block's byte order);
* dtype (the cache element type, plus the cache dtype when quantised: fp8);
* the backend's physical layout name (e.g. "LBHNC"), conservatively: two
  engines whose backends store pages differently never share blocks;
* the KV cache spec: its kind (FullAttentionSpec, SlidingWindowSpec,
  MLAAttentionSpec...), its sliding window, and for MLA the latent layout
  (one compressed KV vector per token and layer, no K/V or heads split:
  "latent"), so that MLA blocks and standard blocks never meet even when
  their sizes agree;
* with several KV cache groups (vLLM's hybrid allocator: interleaved
  sliding-window and full-attention layers), the group's index among them:
  each group is a namespace of its own (its own layers, block table and
  blocks), see connector/groups.py.

A block is serialised as layer 0's page, then layer 1's, ..., each in logical
[H, N, C] order; block_bytes = layers * H * N * C. This module reads vLLM's
config objects by attribute only and imports neither torch nor vLLM.
"""
from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Dict, Optional, Tuple

from .model_identity import model_identity

__all__ = ["KVLayout", "UnsupportedLayout", "layout_from_config", "layouts_from_config",
           "namespace_descriptor", "parallel_ranks"]

LAYOUT_VERSION = "kvk1"


class UnsupportedLayout(ValueError):
    """The engine's KV cache cannot be described as kvkeeper blocks."""


@dataclass(frozen=True)
class KVLayout:
    layer_names: Tuple[str, ...]
    num_heads: int            # H: head slots per page
    block_tokens: int         # N: tokens per block
    content_bytes: int        # C: bytes per (head slot, token)
    dtype: str                # e.g. "float32", "bfloat16", "uint8/fp8_e4m3"
    physical: str             # the backend's physical layout name, e.g. "LBHNC"
    spec_kind: str            # e.g. "FullAttentionSpec"
    window: int = 0           # the layers' sliding window in tokens; 0: full attention
    latent: bool = False      # MLA: one latent vector per token (H == 1, no K/V split)
    group: int = 0            # this KV cache group's index ...
    groups: int = 1           # ... among the engine's groups

    @property
    def layer_bytes(self) -> int:
        return self.num_heads * self.block_tokens * self.content_bytes

    @property
    def block_bytes(self) -> int:
        return self.layer_bytes * len(self.layer_names)

    @property
    def sliding(self) -> bool:
        return self.window > 0

    def layout_string(self) -> str:
        """The namespace's kv_layout: version, physical layout, spec kind (with its
        window, the MLA latent layout, the group among several) and page shape.
        A plain full-attention layout of one group reads as it always has."""
        kind = self.spec_kind
        if self.latent:
            kind += "+latent"
        if self.window:
            kind += f"+W{self.window}"
        if self.groups > 1:   # which group, and which layers are in it
            names = hashlib.sha256("\0".join(self.layer_names).encode()).hexdigest()[:12]
            kind += f"+G{self.group}of{self.groups}@{names}"
        return (f"{LAYOUT_VERSION}:{self.physical}:{kind}:L{len(self.layer_names)}"
                f"xH{self.num_heads}xN{self.block_tokens}xC{self.content_bytes}B")


def _dtype_name(dtype: Any) -> str:
    return str(dtype).replace("torch.", "")


def parallel_ranks(vllm_config: Any) -> Tuple[int, int]:
    """(tp_size, other) where other > 1 means a parallelism kvkeeper does not
    support (pipeline, prefill/decode context parallel)."""
    pc = vllm_config.parallel_config
    tp = int(getattr(pc, "tensor_parallel_size", 1) or 1)
    other = 1
    for name in ("pipeline_parallel_size", "decode_context_parallel_size",
                 "prefill_context_parallel_size"):
        other *= int(getattr(pc, name, 1) or 1)
    return tp, other


def _spec_window(spec: Any) -> int:
    w = getattr(spec, "sliding_window", None)
    return int(w) if isinstance(w, int) and w > 0 else 0


def _is_latent(spec: Any) -> bool:
    """MLA: one latent KV vector per token (vLLM's MLAAttentionSpec, head_size_v 0)."""
    return "MLA" in type(spec).__name__ or getattr(spec, "head_size_v", None) == 0


def _group_layout(vllm_config: Any, kv_cache_config: Any, index: int, count: int) -> KVLayout:
    group = kv_cache_config.kv_cache_groups[index]
    spec = group.kv_cache_spec
    kind = type(spec).__name__
    where = f"KV cache group {index} ({kind})" if count > 1 else f"KV cache spec {kind}"
    if "Mamba" in kind or getattr(spec, "tokens_per_state", 1) == -1:
        raise UnsupportedLayout(f"{where} holds a recurrent (Mamba / linear-attention) state, "
                                "not per-token KV; kvkeeper stores attention KV only, so hybrid "
                                "attention/SSM models are not supported")
    for attr in ("num_heads", "state_content_size_bytes", "block_size", "dtype"):
        if not hasattr(spec, attr):
            raise UnsupportedLayout(f"{where} has no {attr}; only attention caches are "
                                    "supported")
    if getattr(spec, "tokens_per_state", 1) != 1:
        raise UnsupportedLayout(f"{where} stores {spec.tokens_per_state} tokens per state; "
                                "only one state per token is supported")
    if getattr(group, "enable_kv_transfer", True) is False:
        raise UnsupportedLayout(f"{where} has KV transfer disabled")
    names = tuple(group.layer_names)
    if not names:
        raise UnsupportedLayout(f"{where} has no layers")
    block_size = int(spec.block_size)
    cache_block_size = getattr(getattr(vllm_config, "cache_config", None), "block_size", None)
    if cache_block_size and int(cache_block_size) != block_size:
        raise UnsupportedLayout(f"cache block size {cache_block_size} differs from the block "
                                f"size of {where}, {block_size}")
    dtype = _dtype_name(spec.dtype)
    cache_dtype = str(getattr(vllm_config.cache_config, "cache_dtype", "auto") or "auto")
    if cache_dtype not in ("auto", dtype):
        dtype = f"{dtype}/{cache_dtype}"
    physical = (getattr(kv_cache_config, "kv_cache_layout", None)
                or getattr(vllm_config.cache_config, "kv_cache_layout", None) or "default")
    return KVLayout(layer_names=names, num_heads=int(spec.num_heads), block_tokens=block_size,
                    content_bytes=int(spec.state_content_size_bytes), dtype=dtype,
                    physical=str(physical), spec_kind=kind, window=_spec_window(spec),
                    latent=_is_latent(spec), group=index, groups=count)


def layouts_from_config(vllm_config: Any, kv_cache_config: Any) -> Tuple[KVLayout, ...]:
    """The layout of each KV cache group of this engine (several with vLLM's
    hybrid allocator), or UnsupportedLayout saying why they cannot be served."""
    tp, other = parallel_ranks(vllm_config)
    if other != 1:
        raise UnsupportedLayout("pipeline or context parallelism is not supported; "
                                "only tensor parallelism")
    if kv_cache_config is None:
        raise UnsupportedLayout("no KV cache config was given to the connector")
    groups = list(getattr(kv_cache_config, "kv_cache_groups", []) or [])
    if not groups:
        raise UnsupportedLayout("the KV cache config has no KV cache groups")
    out = tuple(_group_layout(vllm_config, kv_cache_config, i, len(groups))
                for i in range(len(groups)))
    if len({lay.block_tokens for lay in out}) != 1:
        raise UnsupportedLayout("the KV cache groups have different block sizes ("
                                + ", ".join(str(lay.block_tokens) for lay in out) + ")")
    seen: Dict[str, int] = {}
    for lay in out:
        for name in lay.layer_names:
            if name in seen:
                raise UnsupportedLayout(f"layer {name} is in KV cache groups {seen[name]} and "
                                        f"{lay.group}")
            seen[name] = lay.group
    return out


def layout_from_config(vllm_config: Any, kv_cache_config: Any) -> KVLayout:
    """The layout of an engine with one KV cache group, or UnsupportedLayout."""
    layouts = layouts_from_config(vllm_config, kv_cache_config)
    if len(layouts) != 1:
        raise UnsupportedLayout(f"{len(layouts)} KV cache groups; KVKeeperConnector serves "
                                "one (vLLM's hybrid allocator off); KVKeeperHMAConnector "
                                "serves several")
    return layouts[0]


def namespace_descriptor(vllm_config: Any, layout: KVLayout, *, tp_rank: int, tp_size: int,
                         model_id: Optional[str] = None,
                         model_revision: Optional[str] = None) -> Dict[str, Any]:
    """The NamespaceDescriptor (as a dict) of one TP rank.

    model_id defaults to the identity of the model vLLM was started with: for
    local files a digest of their content, so the same files under another
    path or on another host give the same id; else the name (see
    model_identity.py). The revision defaults to vLLM's revision plus the
    quantisation method: weights that differ produce different KV for the
    same tokens. kvkeeper_model_id / kvkeeper_model_revision override them.
    """
    mc = vllm_config.model_config
    if model_id is None:
        model_id = model_identity(str(getattr(mc, "model", "") or "")).model_id
    if model_revision is None:
        model_revision = str(getattr(mc, "revision", None) or "")
        quant = getattr(mc, "quantization", None)
        if quant:
            model_revision = f"{model_revision}+{quant}"
    return {
        "model_id": model_id,
        "model_revision": model_revision,
        "dtype": layout.dtype,
        "kv_layout": layout.layout_string(),
        "block_tokens": layout.block_tokens,
        "block_bytes": layout.block_bytes,
        "tp_rank": int(tp_rank),
        "tp_size": int(tp_size),
    }
