"""One vLLM engine (CPU, tiny dummy Llama) driven line by line, for the connector tests.

Run as `python engine_script.py --model DIR [--url URL] [--report] [--extra JSON]`.
It starts an `LLM` of a tiny seeded-random Llama (with KVKeeperConnector when
--url is given; --extra adds kv_connector_extra_config keys), prints
`KVKTEST {"ready": true}` and then answers one JSON command per stdin line
with one `KVKTEST <json>` line on stdout (vLLM's own logs go to stderr/stdout
too; the prefix tells them apart):

  {"cmd": "generate", "prompts": [[ids], ...], "max_tokens": n}
      -> {"outputs": [[ids], ...], "reports": [kv_transfer_params, ...]}
  {"cmd": "reset_prefix_cache"}   -> {"ok": true}   (forget vLLM's own cache)
  {"cmd": "metrics"}              -> {"metrics": {name: value}} (kvkeeper and
                                     external prefix cache counters)
  {"cmd": "exit"}

SIGTERM ends it the way it ends `vllm serve`: a normal exit, in which vLLM
shuts the engine down (the engine core gets SIGTERM and a few seconds).
"""
from __future__ import annotations

import argparse
import json
import os
import signal
import sys
import traceback

from kvkeeper.server.bench.ttft_engine import metrics  # the same counters the bench reads

PREFIX = "KVKTEST "


TINY_LLAMA = {"architectures": ["LlamaForCausalLM"], "model_type": "llama", "hidden_size": 128,
              "intermediate_size": 256, "num_hidden_layers": 2, "num_attention_heads": 4,
              "num_key_value_heads": 2, "vocab_size": 512, "max_position_embeddings": 4096,
              "rms_norm_eps": 1e-5, "torch_dtype": "float32", "bos_token_id": 1,
              "eos_token_id": 2, "tie_word_embeddings": False, "rope_theta": 10000.0,
              "hidden_act": "silu"}


def write_tiny_llama(path: str, seed: int = 1234) -> None:
    """A 2-layer Llama checkpoint with seeded random weights.

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
    tmp = os.path.join(path, "model.safetensors.tmp")
    save_file(t, tmp, metadata={"format": "pt"})
    os.replace(tmp, os.path.join(path, "model.safetensors"))
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(c, f)


def reply(obj: dict) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--url", default="")
    ap.add_argument("--report", action="store_true")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--extra", default="{}", help="more kv_connector_extra_config (JSON)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if not os.path.exists(os.path.join(args.model, "config.json")):
        write_tiny_llama(args.model)  # tests write it once, before starting engines

    from vllm import LLM, SamplingParams

    kw = {}
    if args.url:
        extra = {"kvkeeper_url": args.url, "kvkeeper_report": args.report,
                 **json.loads(args.extra)}
        kw["kv_transfer_config"] = {"kv_connector": "KVKeeperConnector",
                                    "kv_connector_module_path": "kvkeeper.connector",
                                    "kv_role": "kv_both", "kv_connector_extra_config": extra}
    llm = LLM(model=args.model, skip_tokenizer_init=True,
              block_size=args.block_size, max_model_len=2048, dtype="float32",
              enforce_eager=True, disable_log_stats=False, seed=0, **kw)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
    reply({"ready": True})
    for line in sys.stdin:
        line = line.strip()
        if not line:
            continue
        try:
            cmd = json.loads(line)
            op = cmd["cmd"]
            if op == "exit":
                reply({"ok": True})
                break
            if op == "generate":
                sp = SamplingParams(temperature=0, max_tokens=int(cmd["max_tokens"]),
                                    ignore_eos=True)
                outs = llm.generate([{"prompt_token_ids": p} for p in cmd["prompts"]], sp,
                                    use_tqdm=False)
                reply({"outputs": [list(o.outputs[0].token_ids) for o in outs],
                       "reports": [o.kv_transfer_params for o in outs]})
            elif op == "reset_prefix_cache":
                reply({"ok": bool(llm.reset_prefix_cache())})
            elif op == "metrics":
                reply({"metrics": metrics(llm)})
            else:
                reply({"error": f"unknown command {op!r}"})
        except Exception as e:  # report, keep serving
            reply({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
