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

from kvkeeper.server.bench.registry import BenchUsageError

BLOCK_TOKENS = 32
MAX_MODEL_LEN = 4096
# Room for the longest prompt of the ttft matrix plus the one token the floor
# asks for after it (vLLM refuses a prompt longer than max_model_len).
MAX_POSITIONS = 8192

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

# M2 of issue 12 (and the remote-hit shape of issue 10): 6 layers with
# grouped-query attention (12 heads, 4 KV heads), vocab 8192: 12 KiB of KV
# per token, 384 KiB per block, 25 MB for a 2048-token prompt. Its per-layer
# work and KV bytes are what a one-layer model hides.
M2: Dict[str, Any] = {**MODEL, "num_hidden_layers": 6, "num_key_value_heads": 4,
                      "intermediate_size": 2048, "vocab_size": 8192,
                      "max_position_embeddings": MAX_POSITIONS}
M1: Dict[str, Any] = {**MODEL, "max_position_embeddings": MAX_POSITIONS}

# The keys kv_bytes_per_token() and the engines need of a --model config.
REQUIRED_KEYS = ("hidden_size", "num_hidden_layers", "num_attention_heads", "vocab_size")


def load_config(path: str) -> Dict[str, Any]:
    """A Llama-like config.json given with --model; BenchUsageError (naming the
    file) when it is not one. num_key_value_heads defaults to the heads and
    torch_dtype to float32 (the CPU build's fast dtype)."""
    try:
        with open(path) as fh:
            cfg = json.load(fh)
    except (OSError, ValueError) as e:
        raise BenchUsageError(f"--model {path}: cannot read a JSON config: {e}") from e
    if not isinstance(cfg, dict):
        raise BenchUsageError(f"--model {path}: not a JSON object")
    missing = [k for k in REQUIRED_KEYS if not isinstance(cfg.get(k), int)]
    if missing:
        raise BenchUsageError(f"--model {path}: missing or not an integer: "
                              f"{', '.join(missing)}")
    if cfg["hidden_size"] % cfg["num_attention_heads"]:
        raise BenchUsageError(f"--model {path}: hidden_size is not a multiple of the heads")
    out = {**MODEL, **cfg}
    if "num_key_value_heads" not in cfg:
        out["num_key_value_heads"] = cfg["num_attention_heads"]
    if "torch_dtype" not in cfg:
        out["torch_dtype"] = "float32"
    if "max_position_embeddings" not in cfg:
        out["max_position_embeddings"] = MAX_POSITIONS
    return out


def dtype_bytes(cfg: Dict[str, Any]) -> int:
    return {"float32": 4, "float16": 2, "bfloat16": 2}.get(str(cfg.get("torch_dtype")), 4)


def kv_bytes_per_token(cfg: Dict[str, Any] = MODEL) -> int:
    head_dim = cfg.get("head_dim") or cfg["hidden_size"] // cfg["num_attention_heads"]
    return 2 * cfg["num_hidden_layers"] * cfg["num_key_value_heads"] * head_dim * dtype_bytes(cfg)


def write_model(path: str, cfg: Dict[str, Any] = MODEL) -> str:
    """A model directory for dummy weights: `path`/config.json. Returns `path`."""
    os.makedirs(path)
    with open(os.path.join(path, "config.json"), "w") as fh:
        json.dump(cfg, fh)
    return path


def describe(cfg: Dict[str, Any]) -> str:
    """The model as the results' params name it."""
    arch = (cfg.get("architectures") or ["LlamaForCausalLM"])[0]
    name = "Llama" if arch == "LlamaForCausalLM" else arch.replace("ForCausalLM", "")
    return (f"dummy {name}, {cfg['num_hidden_layers']} layer(s), hidden {cfg['hidden_size']}, "
            f"{cfg['num_attention_heads']} heads / {cfg['num_key_value_heads']} KV heads, "
            f"{cfg['torch_dtype']}")


class Prompts:
    """Fresh random token ids; every prompt is new unless a prefix is shared on purpose."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def tokens(self, n: int) -> List[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]
