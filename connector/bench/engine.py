"""One vLLM engine in its own process, driven one JSON line at a time.

    python -m kvkeeper.connector.bench.engine --model DIR
        [--connector {none,kvkeeper,example}] [--url URL] [--report] [--extra JSON]
        [--storage DIR] [--timings FILE] [--block-size 32] [--max-model-len 4096]
        [--max-num-batched-tokens N] [--weights {dummy,checkpoint}] [--prefix-caching]
        [--kv-cache-dtype auto] [--tp 1] [--in-process] [--num-blocks N] [--no-hybrid]

The engine of `kvkeeper bench ttft` and `stream-hit` and of the connector's
engine tests (driver.py starts it and talks to it). Runs with a Python that
has vLLM and torch (both imported in main() only). The model directory holds
a config.json (model.py) and, with `--weights checkpoint`, the weights
(tests/connector/tiny_llama.py); there is no tokenizer (prompts are token
ids). vLLM's own prefix cache is off unless --prefix-caching, so that a
prompt's KV is either computed or comes from the connector. By default the
engine has vLLM's usual process layout (front end, engine core and CPU worker
in three processes); --in-process runs all three in this process
(VLLM_ENABLE_V1_MULTIPROCESSING=0, the uni executor), which starts in a third
of the time.

`--connector kvkeeper` is KVKeeperConnector (`--report`: kvkeeper_report,
each request's kvkeeper report in its kv_transfer_params; `--extra`: more
kv_connector_extra_config), `example` vLLM's ExampleConnector (files in
--storage). With --timings, both are their timed subclasses
(ttft_connector.py: the same classes, plus timing lines in that file).
Prints `KVKENGINE {"ready": true}`, then answers each command line on stdin
with one `KVKENGINE <json>` line (everything else on stdout is vLLM's
logging):

  {"cmd": "generate", "prompts": [[ids], ...], "max_tokens": n, "settle": s,
   "batch": b, "collect": c}
      max_tokens (default 1) tokens of each prompt, greedily; each prompt
      alone, one after the other, each after a pause of `settle` seconds
      (default 0) and, with collect, a gc.collect(); or with batch all of
      them in one llm.generate; with "salt": s, under that cache salt (no
      prefix cache, vLLM's or the daemon's, holds it: a recompute); with
      "kv_transfer_params": {...}, every prompt carries them (e.g.
      {"kvkeeper_last_turn": true}) ->
      {"results": [{"tokens": [ids], "ttft": s, "wall": s, "cached": n,
                    "params": kv_transfer_params,
                    "timings": [timing lines written during the request],
                    "before": [lines written before it: earlier background work],
                    "stages": vLLM's timestamps of it (stages()),
                    "sent": time.monotonic() just before llm.generate (the
                            timing lines' "at" are on the same clock)},
                   ...]}
      ttft is vLLM's first_token_latency (arrival to first token, measured
      by the front end), wall the time llm.generate took.
  {"cmd": "reset_prefix_cache"} -> {"ok": true}   (forget vLLM's own cache)
  {"cmd": "metrics"}  -> {"metrics": {name: value}} (kvkeeper and external
                         prefix cache counters)
  {"cmd": "exit"}

SIGTERM ends it the way it ends `vllm serve`: a normal exit, in which vLLM
shuts the engine down (the engine core gets SIGTERM and a few seconds).
"""
from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import sys
import time
import traceback
from typing import Any, Dict, List, Optional

PREFIX = "KVKENGINE "
TIMED_CONNECTOR_MODULE = "kvkeeper.connector.bench.ttft_connector"
TIMINGS_ENV = "KVKEEPER_BENCH_TIMINGS"   # the same as ttft_connector.TIMINGS_ENV


def reply(obj: Dict[str, Any]) -> None:
    sys.stdout.write(PREFIX + json.dumps(obj) + "\n")
    sys.stdout.flush()


def kv_transfer_config(args: argparse.Namespace) -> Optional[Dict[str, Any]]:
    timed = bool(args.timings)
    if args.connector == "kvkeeper":
        extra = {"kvkeeper_url": args.url, "kvkeeper_report": args.report,
                 **json.loads(args.extra or "{}")}
        cls, module = ("TimedKVKeeperConnector", TIMED_CONNECTOR_MODULE) if timed else \
            ("KVKeeperConnector", "kvkeeper.connector")
    elif args.connector == "example":
        extra = {"shared_storage_path": args.storage}
        # vLLM's own registry knows ExampleConnector: no module path then.
        cls, module = ("TimedExampleConnector", TIMED_CONNECTOR_MODULE) if timed else \
            ("ExampleConnector", "")
    else:
        return None
    cfg: Dict[str, Any] = {"kv_connector": args.connector_class or cls, "kv_role": "kv_both",
                           "kv_connector_extra_config": extra}
    if args.connector_module or module:
        cfg["kv_connector_module_path"] = args.connector_module or module
    return cfg


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


def stages(m: Any, sent: float, ttft: float) -> Dict[str, float]:
    """Where a request's TTFT went, from vLLM's own per-request timestamps
    (the engine core's, on the same monotonic clock as `sent`, the front
    end's time.monotonic() just before llm.generate):
      submit    front end -> the engine core queued it
      queue     queued -> first scheduled (a connector's pending lookup: steps
                that skip it)
      step      scheduled -> first token (the step: loads, forward, sampling)
      out       the rest of the TTFT (the output back to the front end)
    Empty when vLLM gave no timestamps."""
    q, s, f = (float(getattr(m, k, 0.0) or 0.0) for k in ("queued_ts", "scheduled_ts",
                                                          "first_token_ts"))
    if not (q and s and f) or not (sent <= q <= s <= f):
        return {}
    return {"submit": q - sent, "queue": s - q, "step": f - s,
            "out": ttft - (f - sent)}


def generate(llm: Any, timings: Timings, cmd: Dict[str, Any]) -> List[Dict[str, Any]]:
    from vllm import SamplingParams

    kv = cmd.get("kv_transfer_params")
    sp = SamplingParams(temperature=0, max_tokens=int(cmd.get("max_tokens", 1)), ignore_eos=True,
                        extra_args={"kv_transfer_params": dict(kv)} if kv else None)
    prompts = [list(p) for p in cmd["prompts"]]
    results = []
    for group in ([prompts] if cmd.get("batch") else [[p] for p in prompts]):
        # Let earlier requests' background work (saves, releases) end, so
        # that it does not run during this request.
        time.sleep(float(cmd.get("settle", 0.0)))
        before = timings.take()   # lines of that background work
        if cmd.get("collect"):
            # Timed requests only (benchmarks): a collection takes a few hundred
            # ms in an engine process, which the tests' live traffic must not wait for.
            gc.collect()
        t = time.perf_counter()
        sent = time.monotonic()
        salt = {"cache_salt": str(cmd["salt"])} if cmd.get("salt") else {}
        outs = llm.generate([{"prompt_token_ids": p, **salt} for p in group], sp,
                            use_tqdm=False)
        wall = time.perf_counter() - t
        during = timings.take()
        for o in outs:
            m = getattr(o, "metrics", None)
            ttft = getattr(m, "first_token_latency", None) or wall
            results.append({"tokens": list(o.outputs[0].token_ids), "ttft": float(ttft),
                            "wall": wall, "cached": int(getattr(o, "num_cached_tokens", 0) or 0),
                            "params": o.kv_transfer_params, "timings": during,
                            "before": before, "stages": stages(m, sent, float(ttft)),
                            "sent": sent})
    return results


def parse_args(argv: Optional[List[str]] = None) -> argparse.Namespace:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--connector", choices=("none", "kvkeeper", "example"), default="none")
    ap.add_argument("--url", default="")
    ap.add_argument("--report", action="store_true",
                    help="kvkeeper_report: each request's kvkeeper report")
    ap.add_argument("--extra", default="", help="more kv_connector_extra_config (JSON)")
    ap.add_argument("--storage", default="")
    ap.add_argument("--timings", default="")
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=4096)
    ap.add_argument("--max-num-batched-tokens", type=int, default=0,
                    help="default: vLLM's")
    ap.add_argument("--weights", choices=("dummy", "checkpoint"), default="dummy",
                    help="vLLM's dummy weights, or the checkpoint in --model")
    ap.add_argument("--prefix-caching", action="store_true", help="vLLM's own prefix cache")
    ap.add_argument("--kv-cache-dtype", default="auto", help="vLLM's kv_cache_dtype (e.g. fp8)")
    ap.add_argument("--tp", type=int, default=1, help="tensor_parallel_size")
    # for profiling variants: another connector class / module
    ap.add_argument("--connector-class", default="", help=argparse.SUPPRESS)
    ap.add_argument("--connector-module", default="", help=argparse.SUPPRESS)
    ap.add_argument("--num-blocks", type=int, default=0,
                    help="KV cache blocks (vLLM's num_gpu_blocks_override); default: vLLM's")
    ap.add_argument("--no-hybrid", action="store_true",
                    help="vLLM's hybrid KV cache manager off (as under a connector without "
                         "SupportsHMA): sliding-window layers keep every block")
    ap.add_argument("--in-process", action="store_true",
                    help="run the engine core and the worker in this process (starts faster)")
    return ap.parse_args(argv)


def main() -> int:
    args = parse_args()
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    if args.in_process:
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if args.timings:
        os.environ[TIMINGS_ENV] = args.timings   # inherited by the engine core process
    else:
        os.environ.pop(TIMINGS_ENV, None)

    from vllm import LLM

    kw: Dict[str, Any] = {}
    if args.in_process:
        kw["distributed_executor_backend"] = "uni"
    transfer = kv_transfer_config(args)
    if transfer is not None:
        kw["kv_transfer_config"] = transfer
    if args.max_num_batched_tokens:
        kw["max_num_batched_tokens"] = args.max_num_batched_tokens
    if args.num_blocks:
        kw["num_gpu_blocks_override"] = args.num_blocks
    if args.kv_cache_dtype != "auto":
        kw["kv_cache_dtype"] = args.kv_cache_dtype
    if args.tp > 1:
        kw["tensor_parallel_size"] = args.tp
    if args.weights == "dummy":
        kw["load_format"] = "dummy"
    if args.no_hybrid:
        kw["disable_hybrid_kv_cache_manager"] = True
    with open(os.path.join(args.model, "config.json")) as fh:
        dtype = json.load(fh).get("torch_dtype", "float32")
    llm = LLM(model=args.model, skip_tokenizer_init=True, block_size=args.block_size,
              max_model_len=args.max_model_len, dtype=dtype, enforce_eager=True,
              enable_prefix_caching=args.prefix_caching, disable_log_stats=False, seed=0, **kw)
    signal.signal(signal.SIGTERM, lambda signum, frame: sys.exit(0))
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
                reply({"results": generate(llm, timings, cmd)})
            elif op == "reset_prefix_cache":
                reply({"ok": bool(llm.reset_prefix_cache())})
            elif op == "metrics":
                reply({"metrics": metrics(llm)})
            else:
                reply({"error": f"unknown command {op!r}"})
        except Exception as e:  # noqa: BLE001 - report, keep serving
            reply({"error": f"{type(e).__name__}: {e}", "traceback": traceback.format_exc()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
