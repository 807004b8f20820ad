"""The tiny Llama of the engine tests: a config.json, seeded random weights and,
for servers that take text (`vllm serve`), a byte-level BPE tokenizer.

Shared by the engine tests (connector_harness.py: LLM engines fed token ids)
and tests/serving (an OpenAI-compatible `vllm serve` fed text). Nothing is
downloaded: the weights and the tokenizer are built here, the same in every
process.
"""
from __future__ import annotations

import json
import os
import random

TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1,
              "eos_token_id": 2, "tie_word_embeddings": False, "rope_theta": 10000.0,
              "hidden_act": "silu"}

# Ids 0, 1, 2: the config's bos_token_id and eos_token_id point at these.
SPECIAL_TOKENS = ["<unk>", "<s>", "</s>"]


def write_tiny_llama(path: str, seed: int = 1234, tokenizer: bool = False) -> None:
    """A 2-layer Llama checkpoint with seeded random weights (and, with
    `tokenizer`, its tokenizer files: see write_tokenizer).

    Not vLLM's dummy weights: those are so small that attention barely
    moves the residual stream, so the output would not depend on the cached
    KV at all and no test could tell loaded KV from garbage. These are
    scaled like a trained model's (unit-variance activations), so the
    context matters, and identical in every process that reads the file.
    """
    import torch
    from safetensors.torch import save_file

    os.makedirs(path, exist_ok=True)
    c = TINY_LLAMA
    h, inter, v = c["hidden_size"], c["intermediate_size"], c["vocab_size"]
    hd = h // c["num_attention_heads"]
    kvh = c["num_key_value_heads"] * hd
    g = torch.Generator().manual_seed(seed)

    def w(rows: int, cols: int, scale: float) -> torch.Tensor:
        return (torch.randn(rows, cols, generator=g) * scale).contiguous()

    t = {"model.embed_tokens.weight": w(v, h, 1.0), "model.norm.weight": torch.ones(h),
         "lm_head.weight": w(v, h, h ** -0.5)}
    for i in range(c["num_hidden_layers"]):
        p = f"model.layers.{i}."
        t[p + "self_attn.q_proj.weight"] = w(h, h, h ** -0.5)
        t[p + "self_attn.k_proj.weight"] = w(kvh, h, h ** -0.5)
        t[p + "self_attn.v_proj.weight"] = w(kvh, h, h ** -0.5)
        t[p + "self_attn.o_proj.weight"] = w(h, h, h ** -0.5)
        t[p + "mlp.gate_proj.weight"] = w(inter, h, h ** -0.5)
        t[p + "mlp.up_proj.weight"] = w(inter, h, h ** -0.5)
        t[p + "mlp.down_proj.weight"] = w(h, inter, inter ** -0.5)
        t[p + "input_layernorm.weight"] = torch.ones(h)
        t[p + "post_attention_layernorm.weight"] = torch.ones(h)
    if tokenizer:
        write_tokenizer(path, v)
    tmp = os.path.join(path, "model.safetensors.tmp")
    save_file(t, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    # config.json last: its presence means the checkpoint is complete.
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)


def _corpus() -> list:
    # Random letters give enough distinct pairs for the merges to fill the
    # vocabulary; the English words give the prompts of the tests short tokens.
    rng = random.Random(0)
    letters = "abcdefghijklmnopqrstuvwxyz "
    words = ("the of and to in is that it for as with was on be by this are from at or an "
             "which cache block prefix token model server engine request prompt layer memory "
             "shared key value").split()
    return (["".join(rng.choice(letters) for _ in range(200)) for _ in range(300)]
            + [" ".join(rng.choice(words) for _ in range(12)) for _ in range(300)])


def write_tokenizer(path: str, vocab_size: int = TINY_LLAMA["vocab_size"]) -> None:
    """tokenizer.json and tokenizer_config.json for `path`: byte-level BPE of
    exactly `vocab_size` tokens (ids 0-2 special), so every id the model can
    sample decodes and any text encodes (byte fallback). Loads offline with
    transformers' AutoTokenizer, as `vllm serve` does."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(_corpus(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    if tok.get_vocab_size() != vocab_size:
        raise RuntimeError(f"the tokenizer has {tok.get_vocab_size()} tokens, the model "
                           f"{vocab_size}: the training corpus is too small")
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": SPECIAL_TOKENS[1],
                   "eos_token": SPECIAL_TOKENS[2], "unk_token": SPECIAL_TOKENS[0],
                   "add_bos_token": False, "model_max_length": TINY_LLAMA["max_position_embeddings"]},
                  f)


if __name__ == "__main__":
    # `python tests/connector/tiny_llama.py DIR`: the model (with its tokenizer) for a
    # `vllm serve DIR` by hand, as in the README's CPU example.
    import sys

    if len(sys.argv) != 2:
        sys.exit("usage: tiny_llama.py DIR")
    write_tiny_llama(sys.argv[1], tokenizer=True)
    print(sys.argv[1])
