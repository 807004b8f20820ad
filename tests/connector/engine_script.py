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
from tiny_llama import write_tiny_llama  # noqa: F401  (tests import it from here too)

PREFIX = "KVKTEST "


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
