"""The benchmarks' model and prompts: a dummy-weight Llama and fresh random token ids.

The model directory holds only a config.json: the engines load vLLM's dummy
weights (load_format="dummy") and no tokenizer (prompts are token ids), so
nothing is downloaded. The connector tests write their own seeded-weight
model (tests/connector/tiny_llama.py) into a directory of the same kind.
"""
from __future__ import annotations

import json
import os
import random
from typing import Any, Dict, List

BLOCK_TOKENS = 32
MAX_MODEL_LEN = 4096

# A dummy-weight Llama whose 2048-token prefill takes about 1 s on the
# 2-core CPU this was tuned on (vLLM CPU build, fp32: bf16 is ~10x slower
# there). One layer, so the connector's per-layer work is at its smallest;
# 12 KV heads (no GQA), so the bytes per token are at their largest for this
# width: 6 KiB of KV per token, 192 KiB per block.
MODEL: Dict[str, Any] = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 768,
    "intermediate_size": 3072, "num_hidden_layers": 1, "num_attention_heads": 12,
    "num_key_value_heads": 12, "vocab_size": 32000, "max_position_embeddings": MAX_MODEL_LEN,
    "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1, "eos_token_id": 2,
    "tie_word_embeddings": False, "rope_theta": 10000.0, "hidden_act": "silu"}


def kv_bytes_per_token(cfg: Dict[str, Any] = MODEL) -> int:
    head_dim = cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * 4


def write_model(path: str, cfg: Dict[str, Any] = MODEL) -> str:
    """A model directory for dummy weights: `path`/config.json. Returns `path`."""
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return path


def describe(cfg: Dict[str, Any]) -> str:
    """The model as the results' params name it."""
    return (f"dummy Llama, {cfg['num_hidden_layers']} layer(s), hidden {cfg['hidden_size']}, "
            f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, "
            f"{cfg['torch_dtype']}")


class Prompts:
    """Fresh random token ids; every prompt is new unless a prefix is shared on purpose."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def tokens(self, n: int) -> List[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]
