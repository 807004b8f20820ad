"""Tiny configs of the architectures in the connector's model matrix.

Each is a config.json (a dict) vLLM and transformers both read: a few
layers, small hidden sizes, a 512-token vocabulary, float32. The sliding
windows (64 tokens) are two vLLM blocks of 32, so a prompt of a few hundred
tokens leaves most of its blocks outside the window.
"""
from __future__ import annotations

from typing import Any, Dict

__all__ = ["CONFIGS", "WINDOW"]

WINDOW = 64

_BASE: Dict[str, Any] = {
    "hidden_size": 128, "intermediate_size": 256, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 512,
    "max_position_embeddings": 4096, "rms_norm_eps": 1e-5, "torch_dtype": "float32",
    "bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0, "tie_word_embeddings": False,
    "rope_theta": 10000.0, "hidden_act": "silu",
}


def _cfg(arch: str, model_type: str, **kw: Any) -> Dict[str, Any]:
    return {"architectures": [arch], "model_type": model_type, **_BASE, **kw}


CONFIGS: Dict[str, Dict[str, Any]] = {
    "llama": _cfg("LlamaForCausalLM", "llama"),
    "qwen2": _cfg("Qwen2ForCausalLM", "qwen2", use_sliding_window=False),
    "qwen3": _cfg("Qwen3ForCausalLM", "qwen3", head_dim=32),
    "mistral": _cfg("MistralForCausalLM", "mistral", sliding_window=WINDOW, head_dim=32),
    "gemma2": _cfg("Gemma2ForCausalLM", "gemma2", num_hidden_layers=4, head_dim=32,
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=32,
                   sliding_window=WINDOW, attn_logit_softcapping=50.0,
                   final_logit_softcapping=30.0,
                   layer_types=["sliding_attention", "full_attention"] * 2),
    "gemma3": _cfg("Gemma3ForCausalLM", "gemma3_text", num_hidden_layers=4, head_dim=32,
                   hidden_activation="gelu_pytorch_tanh", query_pre_attn_scalar=32,
                   sliding_window=WINDOW, rope_local_base_freq=10000.0,
                   layer_types=["sliding_attention", "full_attention"] * 2),
    "deepseek_v2": _cfg("DeepseekV2ForCausalLM", "deepseek_v2", num_key_value_heads=4,
                        kv_lora_rank=512, q_lora_rank=None, qk_rope_head_dim=64,
                        qk_nope_head_dim=64, v_head_dim=64, first_k_dense_replace=2,
                        n_routed_experts=4, n_shared_experts=1, num_experts_per_tok=2,
                        moe_intermediate_size=64, topk_method="greedy", rope_scaling=None),
    "jamba": _cfg("JambaForCausalLM", "jamba", num_hidden_layers=2, attn_layer_period=2,
                  attn_layer_offset=1, expert_layer_period=4, expert_layer_offset=3,
                  num_experts=1, num_experts_per_tok=1, mamba_d_state=16, mamba_d_conv=4,
                  mamba_expand=2, mamba_dt_rank=8, use_mamba_kernels=False),
    "qwen3_next": _cfg("Qwen3NextForCausalLM", "qwen3_next", num_hidden_layers=4, head_dim=32,
                       linear_conv_kernel_dim=4, linear_key_head_dim=32,
                       linear_value_head_dim=32, linear_num_key_heads=2,
                       linear_num_value_heads=4, num_experts=4, num_experts_per_tok=2,
                       moe_intermediate_size=64, shared_expert_intermediate_size=64,
                       decoder_sparse_step=1, full_attention_interval=2,
                       layer_types=["linear_attention", "full_attention"] * 2),
}
