"""One vLLM engine for `kvkeeper bench ttft`, driven one JSON line at a time.

    python -m kvkeeper.server.bench.ttft_engine --model DIR
        --connector {none,kvkeeper,example} [--url URL] [--storage DIR]
        [--timings FILE] [--block-size 32] [--max-model-len 4096] [--in-process]

Runs inside the engine's own process with a Python that has vLLM and torch
(both imported in main() only). The model directory holds only a
config.json: weights are vLLM's dummy weights (load_format="dummy"), there is
no tokenizer (prompts are token ids). vLLM's own prefix cache is disabled, so
a prompt's KV either is computed or comes from the connector. By default
the engine has vLLM's usual process layout (front end, engine core and CPU
worker in three processes); --in-process runs all three in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni executor), which starts in a third
of the time (for --quick).

`--connector kvkeeper` uses TimedKVKeeperConnector and `example` vLLM's
ExampleConnector as TimedExampleConnector (ttft_connector.py: the same
classes, plus timing lines in --timings). Prints `KVKBENCH {"ready": true}`,
then answers each command line on stdin with one `KVKBENCH <json>` line
(everything else on stdout is vLLM's logging):

  {"cmd": "generate", "prompts": [[ids], ...], "settle": s}
      each prompt alone, max_tokens=1, one after the other, each after a
      pause of `settle` seconds ->
      {"results": [{"ttft": s, "wall": s, "cached": n, "params": kv_transfer_params,
                    "timings": [timing lines written during the request],
                    "before": [lines written before it: earlier background work]},
                   ...]}
      ttft is vLLM's first_token_latency (arrival to first token, measured
      by the front end), wall the time llm.generate took.
  {"cmd": "metrics"}  -> {"metrics": {name: value}} (kvkeeper and external
                         prefix cache counters)
  {"cmd": "exit"}
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time
import traceback
from typing import Any, Dict, List

PREFIX = "KVKBENCH "
CONNECTOR_MODULE = "kvkeeper.server.bench.ttft_connector"
TIMINGS_ENV = "KVKEEPER_BENCH_TIMINGS"   # the same as ttft_connector.TIMINGS_ENV


def reply(obj: Dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def kv_transfer_config(args: argparse.Namespace) -> Dict[str, Any]:
    module = args.connector_module or CONNECTOR_MODULE
    if args.connector == "kvkeeper":
        extra = {"kvkeeper_url": args.url, "kvkeeper_report": True}
        extra.update(json.loads(args.extra or "{}"))
        return {"kv_connector": args.connector_class or "TimedKVKeeperConnector",
                "kv_connector_module_path": module, "kv_role": "kv_both",
                "kv_connector_extra_config": extra}
    if args.connector == "example":
        return {"kv_connector": args.connector_class or "TimedExampleConnector",
                "kv_connector_module_path": module, "kv_role": "kv_both",
                "kv_connector_extra_config": {"shared_storage_path": args.storage}}
    raise ValueError(args.connector)


class Timings:
    """Reads the lines the engine's connector appended since the last call."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.pos = 0

    def take(self) -> List[Dict[str, Any]]:
        if not self.path or not os.path.exists(self.path):
            return []
        with open(self.path) as fh:
            fh.seek(self.pos)
            text = fh.read()
        end = text.rfind("\n") + 1   # a partial last line waits for the next call
        self.pos += len(text[:end].encode())
        return [json.loads(line) for line in text[:end].splitlines() if line.strip()]


def metrics(llm: Any) -> Dict[str, float]:
    out: Dict[str, float] = {}
    for m in llm.get_metrics():
        name = getattr(m, "name", "")
        if not (name.startswith("vllm:kvkeeper_") or name.startswith("vllm:external_prefix")):
            continue
        value = getattr(m, "value", None)
        if isinstance(value, (int, float)):
            out[name] = out.get(name, 0) + value
    return out


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--connector", choices=("none", "kvkeeper", "example"), default="none")
    ap.add_argument("--url", default="")
    ap.add_argument("--storage", default="")
    ap.add_argument("--timings", default="")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    # for profiling variants: another connector class / module, more extra config
    ap.add_argument("--connector-class", default="", help=argparse.SUPPRESS)
    ap.add_argument("--connector-module", default="", help=argparse.SUPPRESS)
    ap.add_argument("--extra", default="", help=argparse.SUPPRESS)
    ap.add_argument("--in-process", action="store_true",
                    help="run the engine core and the worker in this process (starts faster)")
    args = ap.parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.timings:
        os.environ[TIMINGS_ENV] = args.timings   # inherited by the engine core process
    else:
        os.environ.pop(TIMINGS_ENV, None)

    from vllm import LLM, SamplingParams

    kw: Dict[str, Any] = {}
    if args.in_process:
        kw["distributed_executor_backend"] = "uni"
    if args.connector != "none":
        kw["kv_transfer_config"] = kv_transfer_config(args)
    with open(os.path.join(args.model, "config.json")) as fh:
        dtype = json.load(fh).get("torch_dtype", "float32")
    llm = LLM(model=args.model, load_format="dummy", skip_tokenizer_init=True,
              block_size=args.block_size, max_model_len=args.max_model_len,
              max_num_batched_tokens=args.max_model_len, dtype=dtype, enforce_eager=True,
              enable_prefix_caching=False, disable_log_stats=False, seed=0, **kw)
    sp = SamplingParams(temperature=0, max_tokens=1, ignore_eos=True)
    timings = Timings(args.timings)
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
                results = []
                for p in cmd["prompts"]:
                    # Let earlier requests' background work (saves, releases) end,
                    # so that it does not run during this request.
                    time.sleep(float(cmd.get("settle", 0.0)))
                    before = timings.take()   # lines of that background work
                    gc.collect()
                    t = time.perf_counter()
                    outs = llm.generate([{"prompt_token_ids": list(p)}], sp, use_tqdm=False)
                    wall = time.perf_counter() - t
                    o = outs[0]
                    m = getattr(o, "metrics", None)
                    ttft = getattr(m, "first_token_latency", None) or wall
                    results.append({"ttft": float(ttft), "wall": wall,
                                    "cached": int(getattr(o, "num_cached_tokens", 0) or 0),
                                    "params": o.kv_transfer_params,
                                    "timings": timings.take(), "before": before})
                reply({"results": results})
            elif op == "metrics":
                reply({"metrics": metrics(llm)})
            else:
                reply({"error": f"unknown command {op!r}"})
        except Exception as e:  # noqa: BLE001 - report, keep serving
            reply({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
