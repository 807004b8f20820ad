"""Connector benchmark: time to first token of a full and a partial prefix hit.

    kvkeeper bench ttft [--json] [--quick] [--engine-python PATH]

Needs vLLM and torch, in the Python that runs the engines (--engine-python,
$KVKEEPER_BENCH_PYTHON, else this interpreter); this module itself imports
neither (and nothing the daemon imports imports it). It starts a kvkeeper
daemon (serve_helper.py: the real daemon, shared memory, a unix socket) and
four vLLM engines, each in its own processes (ttft_engine.py), all on the
same dummy-weight Llama (MODEL: one layer of hidden 768, 12 heads, 12 KV
heads, fp32, vocab 32000: its 2048-token prefill takes about 1 s on one core
of the 2-core CPU it was tuned on), blocks of 32 tokens, vLLM's own prefix
caching disabled (so a hit can only come from the connector):

  recompute  no connector: every prompt is computed
  kvk-a      KVKeeperConnector: computes prompts and saves them to the daemon
  kvk-b      KVKeeperConnector: loads what kvk-a saved (another process, as
             another vLLM instance would)
  example    vLLM's in-tree ExampleConnector (kv_connector "ExampleConnector":
             safetensors files in a local directory, here in the page cache):
             each prompt is sent twice, the first saves it, the second
             (measured) loads it

Every engine's CPU worker computes on one core with one thread
(VLLM_CPU_NUM_OF_RESERVED_CPU=1: vLLM would otherwise give connector engines
both cores of a 2-core machine and the recompute engine one); the other core
is left to the engine cores, the front ends, the daemon and connector threads.
--quick runs each engine in a single process (VLLM_ENABLE_V1_MULTIPROCESSING=0),
which starts three times faster; the full run keeps vLLM's usual layout (front
end, engine core, worker).

TTFT is vLLM's per-request first_token_latency (arrival to first token, as
the front end sees it) of one request at a time with max_tokens=1. Each
repetition uses fresh random prompts and runs every engine in turn (so noise
from the machine hits all of them alike), each request after a pause: 0.25 s
for earlier requests' background work (saves, releases) to end, 1.3 s when
the previous request ran on another engine (vLLM's worker and engine core
busy-poll for 1 s after each step: see SWITCH_SETTLE_S). The median of the
repetitions is reported, after untimed warm-ups. Per repetition:

  full hit     a 2048-token prompt (512 with --quick): kvk-a computes and
               saves it; recompute computes it; kvk-b loads all 64 blocks,
               reports 2047 hit tokens (511) and computes the last token
               only (vLLM always computes it); example saves it, then loads
               2016 tokens (480: 63 blocks, it never loads the last block)
               and computes 32
  partial hit  a 1536-token prefix (384) shared with a prompt kvk-a saved,
               plus 512 new tokens (128): recompute computes all of it, kvk-b
               loads the prefix and computes the rest

Both recompute requests of a repetition are fresh prompts of the same length
on the same engine, so every recompute baseline is the median of both (2 x
repetitions samples).

Every hit is verified, or the benchmark fails: kvk-b's per-request report
(kv_transfer_params["kvkeeper"]["hit_tokens"]), its worker's loaded blocks
and its counters (loaded blocks, no load or checksum errors) must show the
whole hit loaded; example's second request must report the hit as cached
tokens; recompute and kvk-a must report none.

Results (seconds; ratio = value / baseline):

  ttft.full_hit.kvkeeper_vs_recompute          target <= 0.1
  ttft.full_hit.kvkeeper_vs_example_connector  target <= 0.5
  ttft.partial_hit.kvkeeper_vs_recompute       informational
  ttft.full_hit.example_connector_vs_recompute informational
  ttft.miss.kvkeeper_vs_recompute              informational: kvk-a on fresh
        prompts (a lookup that misses, the prefill, copying the new blocks out)
  ttft.full_hit.connector_cost.kvkeeper_vs_example_connector  informational:
        what each connector itself spends of a full hit's TTFT (the scheduler's
        lookup and the worker's load before the forward pass)

params carry every sample, the verified hit, and the median breakdown of a
hit measured inside the engines (ttft_connector.py): lookup, load (what the
step waited for the loads; kvkeeper's phases: fetch = the worker's Match with
the blocks' arena refs, copy = arena -> KV cache, check = CRC32 of the copied
blocks, the last two partly beside the forward on the spare core; layer_wait
and check_wait = what the forward and the end of the step waited for them),
forward, save, and other (the rest of the TTFT:
front end, IPC, scheduling, sampling, output), plus the machine's load
average (other work on the machine makes every figure noisier). About 4
minutes on a 2-core CPU (--quick: about 1 minute), half of it the engines'
start-up.
"""
from __future__ import annotations

import json
import os
import queue
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from . import BenchUnavailable
from .result import Result, median
from .servers import ServerProcess

PREFIX = "KVKBENCH "
PYTHON_ENV = "KVKEEPER_BENCH_PYTHON"
BLOCK_TOKENS = 32
MAX_MODEL_LEN = 4096
READY_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 300.0
# Pauses before each measured request. Within one engine, earlier requests'
# background work (kvkeeper's saves and releases) ends. Between engines, the
# one that ran last stops spinning: vLLM's worker and engine core busy-poll
# their shared-memory queues (sched_yield) for 1 s after their last message
# (shm_broadcast.SpinCondition), which on a small machine would take CPU from
# the next engine's request.
SETTLE_S = 0.25
SWITCH_SETTLE_S = 1.3

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


@dataclass(frozen=True)
class Scale:
    prompt_tokens: int      # full-hit prompt
    shared_tokens: int      # partial hit: shared prefix; the rest is new
    reps: int
    warmups: int
    in_process: bool        # engines in one process each (faster start, not vLLM's layout)

    @classmethod
    def for_mode(cls, quick: bool) -> "Scale":
        if quick:
            return cls(prompt_tokens=512, shared_tokens=384, reps=2, warmups=1, in_process=True)
        return cls(prompt_tokens=2048, shared_tokens=1536, reps=7, warmups=2, in_process=False)


class VerificationError(RuntimeError):
    """A hit the benchmark relies on did not happen: its figures would be wrong."""


def engine_python() -> str:
    return os.environ.get(PYTHON_ENV) or sys.executable


def check_vllm(python: str) -> None:
    code = ("import importlib.util, sys; "
            "sys.exit(0 if all(importlib.util.find_spec(m) for m in ('vllm', 'torch')) else 3)")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise BenchUnavailable(f"cannot run {python}: {e}") from e
    if r.returncode != 0:
        raise BenchUnavailable(
            f"it needs vLLM and torch in the engines' Python, and {python} lacks one or "
            f"both; pass --engine-python PATH (or set ${PYTHON_ENV}) to a Python with vLLM")


# --------------------------------------------------------------------------- engines
class Engine:
    """ttft_engine.py in its own process group, one JSON command at a time."""

    def __init__(self, name: str, python: str, args: List[str], log_path: str,
                 env: Dict[str, str]) -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [python, "-m", "kvkeeper.server.bench.ttft_engine", *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True, env=env,
                                     start_new_session=True)
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        threading.Thread(target=self._pump, name=f"bench-{name}", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._lines.put(line[len(PREFIX):])
            else:
                self._log.write(line)
        self._lines.put(None)

    def log_tail(self, n: int = 3000) -> str:
        try:
            self._log.flush()
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except OSError:
            return ""

    def read(self, timeout: float) -> Dict[str, Any]:
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise RuntimeError(f"engine {self.name}: no answer in {timeout:.0f} s; log "
                               f"{self.log_path}:\n{self.log_tail()}") from None
        if line is None:
            raise RuntimeError(f"engine {self.name} exited ({self.proc.poll()}); log "
                               f"{self.log_path}:\n{self.log_tail()}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"engine {self.name}: {out['error']}\n{out.get('traceback', '')}")
        return out

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "Engine":
        if not self.read(timeout).get("ready"):
            raise RuntimeError(f"engine {self.name} did not start")
        return self

    def call(self, timeout: float = CALL_TIMEOUT_S, **cmd: Any) -> Dict[str, Any]:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        return self.read(timeout)

    def generate(self, prompts: Sequence[Sequence[int]]) -> List[Dict[str, Any]]:
        return self.call(cmd="generate", prompts=[list(p) for p in prompts])["results"]

    def one(self, prompt: Sequence[int], settle: float = SETTLE_S) -> Dict[str, Any]:
        return self.call(cmd="generate", prompts=[list(prompt)], settle=settle)["results"][0]

    def metrics(self) -> Dict[str, float]:
        return self.call(cmd="metrics")["metrics"]

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(timeout=30, cmd="exit")
            except Exception:  # noqa: BLE001
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # the engine core and workers are in the engine's process group
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


# --------------------------------------------------------------------------- prompts
class Prompts:
    """Fresh random token ids; every prompt is new unless a prefix is shared on purpose."""

    def __init__(self, vocab: int, seed: int) -> None:
        self.rng = random.Random(seed)
        self.vocab = vocab

    def tokens(self, n: int) -> List[int]:
        return [self.rng.randrange(3, self.vocab) for _ in range(n)]


# --------------------------------------------------------------------------- checks
def kvk_hit(res: Dict[str, Any]) -> int:
    rep = (res.get("params") or {}).get("kvkeeper")
    if not rep:
        raise VerificationError(f"no kvkeeper report in kv_transfer_params: {res.get('params')}")
    return int(rep["hit_tokens"])


def expect_hits(what: str, got: Sequence[int], want: int) -> None:
    bad = [g for g in got if g != want]
    if bad:
        raise VerificationError(f"{what}: expected {want} hit tokens in every request, got "
                                f"{list(got)}; the figures would not measure a hit")


class Bench:
    def __init__(self, scale: Scale, log: Callable[[str], None], python: str,
                 tmp: str) -> None:
        self.s = scale
        self.log = log
        self.python = python
        self.tmp = tmp
        self.prompts = Prompts(MODEL["vocab_size"], seed=20240601)
        # kvkeeper loads every full block and reports all but the last token;
        # ExampleConnector stops at the last block boundary before it.
        full_blocks = scale.prompt_tokens // BLOCK_TOKENS
        self.full_hit = min(full_blocks * BLOCK_TOKENS, scale.prompt_tokens - 1)
        self.full_hit_blocks = -(-self.full_hit // BLOCK_TOKENS)
        self.example_full_hit = (scale.prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS
        self.partial_hit = scale.shared_tokens // BLOCK_TOKENS * BLOCK_TOKENS
        self.daemon: Optional[ServerProcess] = None
        self.engines: Dict[str, Engine] = {}
        self.client: Any = None
        self.foreign: Optional[Dict[str, float]] = None
        self.last_engine = ""

    # ---- set-up

    def start(self) -> None:
        model = os.path.join(self.tmp, "model")
        os.makedirs(model)
        with open(os.path.join(model, "config.json"), "w") as fh:
            json.dump(MODEL, fh)
        storage = os.path.join(self.tmp, "example-store")
        os.makedirs(storage)
        block_bytes = kv_bytes_per_token() * BLOCK_TOKENS
        prompts_saved = 2 * (self.s.reps + self.s.warmups + 1)
        capacity = max(256 << 20, 2 * prompts_saved * (self.s.prompt_tokens // BLOCK_TOKENS + 1)
                       * block_bytes)
        self.daemon = ServerProcess.kvkeeper(self.tmp, capacity=capacity, page_bytes=64 << 10)
        self.daemon.start()
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        # vLLM's CPU worker keeps one core for the engine core process and,
        # when a KV connector is configured, one more for the connector: on a
        # 2-core machine that leaves none, so it falls back to every core and
        # a connector engine would compute with twice the threads of the
        # recompute engine. The same reservation for all engines keeps the
        # compute alike (the connectors' threads share the reserved core).
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
        common = ["--model", model, "--block-size", str(BLOCK_TOKENS),
                  "--max-model-len", str(MAX_MODEL_LEN)]
        if self.s.in_process:
            common.append("--in-process")
        # For A/B runs of connector settings: extra kv_connector_extra_config (JSON).
        kvk_extra = ["--extra", os.environ["KVKEEPER_BENCH_CONNECTOR_EXTRA"]] \
            if os.environ.get("KVKEEPER_BENCH_CONNECTOR_EXTRA") else []
        specs = {
            "recompute": ["--connector", "none"],
            "kvk-a": ["--connector", "kvkeeper", "--url", self.daemon.url,
                      "--timings", os.path.join(self.tmp, "timings-kvk-a.jsonl"), *kvk_extra],
            "kvk-b": ["--connector", "kvkeeper", "--url", self.daemon.url,
                      "--timings", os.path.join(self.tmp, "timings-kvk-b.jsonl"), *kvk_extra],
            "example": ["--connector", "example", "--storage", storage,
                        "--timings", os.path.join(self.tmp, "timings-example.jsonl")],
        }
        t0 = time.perf_counter()
        self.log(f"ttft: starting {len(specs)} vLLM engines ({self.python})")
        for name, args in specs.items():
            self.engines[name] = Engine(name, self.python, common + args,
                                        os.path.join(self.tmp, f"engine-{name}.log"), env)
        with ThreadPoolExecutor(len(specs)) as pool:
            for f in [pool.submit(e.wait_ready) for e in self.engines.values()]:
                f.result()
        self.log(f"ttft: engines ready in {time.perf_counter() - t0:.0f}s")

    def close(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass
        for e in self.engines.values():
            e.close()
        if self.daemon is not None:
            self.daemon.stop()

    # ---- the daemon's view

    def _stored(self, report: Dict[str, Any], tokens: Sequence[int]) -> Tuple[int, int]:
        """(blocks of `tokens` the daemon holds, full blocks of `tokens`)."""
        from kvkeeper.client import Client
        from kvkeeper.connector.keys import chain_keys

        info = report["kvkeeper"]
        if self.client is None:
            assert self.daemon is not None
            self.client = Client.connect(self.daemon.url, info["namespace"],
                                         instance_id="kvkeeper bench ttft", timeout=5.0)
        keys = chain_keys(bytes.fromhex(info["seed"]), list(tokens), int(info["block_tokens"]))
        # report_use: a probe, not a lookup or hit of the daemon's counters.
        return self.client.match(keys, report_use=True).matched, len(keys)

    def wait_saved(self, saved: Sequence[Tuple[Dict[str, Any], List[int]]],
                   timeout: float = 60.0) -> None:
        """Saves are sent in the background: wait until every full block of
        each (request result, tokens) pair is committed in the daemon."""
        deadline = time.monotonic() + timeout
        for res, tokens in saved:
            while True:
                got, want = self._stored(res["params"], tokens)
                if got >= want:
                    break
                if time.monotonic() > deadline:
                    raise VerificationError(f"only {got} of {want} blocks of a prompt were "
                                            f"saved within {timeout:.0f} s")
                time.sleep(0.02)

    # ---- one round

    def one(self, engine: str, prompt: Sequence[int]) -> Dict[str, Any]:
        settle = SETTLE_S if engine == self.last_engine else SWITCH_SETTLE_S
        self.last_engine = engine
        return self.engines[engine].one(prompt, settle=settle)

    def round(self) -> Dict[str, Any]:
        """Every engine once on fresh prompts; the samples of this round."""
        n, shared = self.s.prompt_tokens, self.s.shared_tokens
        full = self.prompts.tokens(n)
        prefix = self.prompts.tokens(shared)
        src = prefix + self.prompts.tokens(n - shared)      # what kvk-a saves
        partial = prefix + self.prompts.tokens(n - shared)  # shares only the prefix
        a_full = self.one("kvk-a", full)
        a_src = self.one("kvk-a", src)
        # kvk-a sends its saves in the background: all of it is in the daemon
        # (and nothing is still being sent) before anything else is measured.
        self.wait_saved([(a_full, full), (a_src, src)])
        r_full = self.one("recompute", full)
        r_partial = self.one("recompute", partial)
        b_full = self.one("kvk-b", full)
        b_partial = self.one("kvk-b", partial)
        self.wait_saved([(b_partial, partial)])   # kvk-b saves the blocks it computed
        x_save = self.one("example", full)
        x_full = self.one("example", full)
        # Verify, also in warm-ups (a broken set-up fails before the long part).
        expect_hits("kvkeeper full hit (kvk-b)", [kvk_hit(b_full)], self.full_hit)
        expect_hits("kvkeeper partial hit (kvk-b)", [kvk_hit(b_partial)], self.partial_hit)
        expect_hits("kvk-a (fresh prompts, must miss)", [kvk_hit(a_full), kvk_hit(a_src)], 0)
        expect_hits("recompute (no connector, no prefix cache)",
                    [r_full["cached"], r_partial["cached"]], 0)
        expect_hits("ExampleConnector first request (saves)", [x_save["cached"]], 0)
        expect_hits("ExampleConnector full hit (num_cached_tokens)", [x_full["cached"]],
                    self.example_full_hit)
        for res, want, want_blocks in ((b_full, self.full_hit, self.full_hit_blocks),
                                       (b_partial, self.partial_hit,
                                        self.partial_hit // BLOCK_TOKENS)):
            loads = [t for t in res["timings"] if t.get("event") == "load"]
            blocks = sum(t["blocks"] for t in loads)
            if blocks != want_blocks:
                raise VerificationError(f"kvk-b's worker loaded {blocks} blocks for a hit of "
                                        f"{want} tokens ({loads}); expected {want_blocks}")
        return {"recompute_full": r_full, "recompute_partial": r_partial, "kvk_full": b_full,
                "kvk_partial": b_partial, "kvk_miss": a_full, "kvk_save_src": a_src,
                "example_full": x_full, "example_save": x_save}

    def _our_pids(self) -> List[int]:
        pids = [os.getpid()]
        if self.daemon is not None and self.daemon.proc is not None:
            pids.append(self.daemon.proc.pid)
        return pids

    def run(self) -> List[Result]:
        self.start()
        groups = [e.proc.pid for e in self.engines.values()]   # each its own session
        cpu0 = _cpu_seconds(groups, self._our_pids())
        t0 = time.monotonic()
        for i in range(self.s.warmups):
            self.round()
            self.log(f"ttft: warm-up {i + 1}/{self.s.warmups} done")
        before = self.engines["kvk-b"].metrics()
        rounds = []
        for i in range(self.s.reps):
            rounds.append(self.round())
            r = rounds[-1]
            self.log(f"ttft: repetition {i + 1}/{self.s.reps}: recompute "
                     f"{r['recompute_full']['ttft']:.3f}s, kvkeeper hit "
                     f"{r['kvk_full']['ttft'] * 1e3:.1f}ms, example hit "
                     f"{r['example_full']['ttft'] * 1e3:.1f}ms, kvkeeper partial "
                     f"{r['kvk_partial']['ttft']:.3f}s")
        after = self.engines["kvk-b"].metrics()
        cpu1 = _cpu_seconds(groups, self._our_pids())
        if cpu0 is not None and cpu1 is not None:
            self.foreign = {"seconds": round(time.monotonic() - t0, 1),
                            "cpu_seconds_of_other_processes": round(
                                (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1]), 1)}
        self._check_counters(before, after)
        return self.results(rounds)

    def _check_counters(self, before: Dict[str, float], after: Dict[str, float]) -> None:
        def delta(name: str) -> float:
            return after.get(f"vllm:kvkeeper_{name}", 0) - before.get(f"vllm:kvkeeper_{name}", 0)

        want_blocks = self.s.reps * (self.full_hit_blocks + self.partial_hit // BLOCK_TOKENS)
        if delta("loaded_blocks") != want_blocks or delta("load_error_blocks") \
                or delta("checksum_errors"):
            raise VerificationError(
                f"kvk-b's counters: loaded_blocks +{delta('loaded_blocks'):.0f} (expected "
                f"+{want_blocks}), load_error_blocks +{delta('load_error_blocks'):.0f}, "
                f"checksum_errors +{delta('checksum_errors'):.0f}")

    # ---- results

    def results(self, rounds: List[Dict[str, Any]]) -> List[Result]:
        def ttfts(key: str) -> List[float]:
            return [r[key]["ttft"] for r in rounds]

        def med(key: str) -> float:
            return median(ttfts(key))

        def samples(key: str) -> List[float]:
            return [round(x, 5) for x in ttfts(key)]

        def walls(key: str) -> List[float]:
            return [round(r[key]["wall"], 5) for r in rounds]

        # Both recompute requests of a round are fresh prompts of the same
        # length on the same engine: one pool of 2 x reps samples for every
        # recompute baseline (the first request of a round tends to be slower).
        recompute = ttfts("recompute_full") + ttfts("recompute_partial")
        rmed = median(recompute)
        rsamples = [round(x, 5) for x in recompute]

        s = self.s
        model = (f"dummy Llama, {MODEL['num_hidden_layers']} layer(s), hidden "
                 f"{MODEL['hidden_size']}, {MODEL['num_attention_heads']} heads / "
                 f"{MODEL['num_key_value_heads']} KV heads, {MODEL['torch_dtype']}, vocab "
                 f"{MODEL['vocab_size']}")
        common = {"model": model, "block_tokens": BLOCK_TOKENS, "reps": s.reps,
                  "warmups": s.warmups, "kv_bytes_per_token": kv_bytes_per_token(),
                  "engine_processes": ("one per engine (--quick)" if s.in_process else
                                       "front end, engine core, worker (vLLM's default)"),
                  "vllm_cpu_reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
                  "cpus": os.cpu_count(),
                  # CPU time the machine spent on processes other than this
                  # benchmark's while the repetitions ran: more than a few
                  # seconds means other work shared the CPUs (noisier figures)
                  "repetitions_wall_and_other_cpu": self.foreign,
                  "ttft": "vLLM first_token_latency of one request, max_tokens=1, median",
                  "vllm_prefix_caching": False}
        full = {**common, "prompt_tokens": s.prompt_tokens, "hit_tokens": self.full_hit,
                "example_hit_tokens": self.example_full_hit, "hit_verified": True,
                "loaded_bytes": self.full_hit_blocks * BLOCK_TOKENS * kv_bytes_per_token()}
        partial = {**common, "prompt_tokens": s.prompt_tokens, "shared_prefix_tokens":
                   s.shared_tokens, "hit_tokens": self.partial_hit, "hit_verified": True}
        kvk_breakdown = breakdown(rounds, "kvk_full")
        x_breakdown = breakdown(rounds, "example_full")
        out = [
            Result(name="ttft.full_hit.kvkeeper_vs_recompute", value=med("kvk_full"), unit="s",
                   baseline_name=f"recompute of the {s.prompt_tokens}-token prompt (no cache)",
                   baseline_value=rmed, better="lower", target="<= 0.1",
                   params={**full, "samples": samples("kvk_full"),
                           "baseline_samples": rsamples,
                           "wall_samples": walls("kvk_full"),
                           "baseline_wall_samples": walls("recompute_full")
                           + walls("recompute_partial"),
                           "kvkeeper_breakdown_s": kvk_breakdown},
                   note="engine kvk-b loads what engine kvk-a saved (another process)"),
            Result(name="ttft.full_hit.kvkeeper_vs_example_connector", value=med("kvk_full"),
                   unit="s",
                   baseline_name="vLLM ExampleConnector full hit (safetensors files, local dir)",
                   baseline_value=med("example_full"), better="lower", target="<= 0.5",
                   params={**full, "samples": samples("kvk_full"),
                           "baseline_samples": samples("example_full"),
                           "kvkeeper_breakdown_s": kvk_breakdown,
                           "example_breakdown_s": x_breakdown},
                   note="ExampleConnector saves with a first request of the prompt and loads "
                        "with the second, in one engine"),
            Result(name="ttft.partial_hit.kvkeeper_vs_recompute", value=med("kvk_partial"),
                   unit="s", baseline_name=f"recompute of the {s.prompt_tokens}-token prompt",
                   baseline_value=rmed, better="lower",
                   params={**partial, "samples": samples("kvk_partial"),
                           "baseline_samples": rsamples,
                           "kvkeeper_breakdown_s": breakdown(rounds, "kvk_partial")},
                   note=f"{s.shared_tokens} tokens shared with a saved prompt, "
                        f"{s.prompt_tokens - s.shared_tokens} new"),
            Result(name="ttft.full_hit.example_connector_vs_recompute",
                   value=med("example_full"), unit="s",
                   baseline_name=f"recompute of the {s.prompt_tokens}-token prompt (no cache)",
                   baseline_value=rmed, better="lower",
                   params={**full, "samples": samples("example_full"),
                           "baseline_samples": rsamples,
                           "example_save_samples": samples("example_save")}),
            Result(name="ttft.miss.kvkeeper_vs_recompute", value=med("kvk_miss"), unit="s",
                   baseline_name=f"recompute of the {s.prompt_tokens}-token prompt (no cache)",
                   baseline_value=rmed, better="lower",
                   params={**common, "prompt_tokens": s.prompt_tokens,
                           "samples": samples("kvk_miss"),
                           "baseline_samples": rsamples,
                           "kvkeeper_breakdown_s": breakdown(rounds, "kvk_miss")},
                   note="engine kvk-a on fresh prompts: a lookup that misses, the prefill, "
                        "and copying the new blocks out of the KV cache to save them "
                        "(sending them happens after, in the background: save_sent_s)"),
            Result(name="ttft.full_hit.connector_cost.kvkeeper_vs_example_connector",
                   value=median(connector_cost(rounds, "kvk_full")), unit="s",
                   baseline_name="ExampleConnector lookup + load of the same hit",
                   baseline_value=median(connector_cost(rounds, "example_full")),
                   better="lower",
                   params={**full, "samples": [round(x, 6) for x in
                                               connector_cost(rounds, "kvk_full")],
                           "baseline_samples": [round(x, 6) for x in
                                                connector_cost(rounds, "example_full")]},
                   note="the part of a full hit's TTFT each connector itself spends: the "
                        "scheduler's lookup and the worker's load before the forward pass "
                        "(measured in the engine, ttft_connector.py)"),
        ]
        save_sent = [t["dur"] for r in rounds for key in ("kvk_miss", "kvk_save_src")
                     for t in (r[key].get("timings") or []) + (r[key].get("before") or [])
                     if t.get("event") == "save_sent"]
        if save_sent:
            out[4].params["save_sent_s"] = round(median(save_sent), 6)
        return out


def _cpu_seconds(groups: Sequence[int], pids: Sequence[int]) -> Optional[Tuple[float, float]]:
    """(busy CPU seconds of the whole machine, CPU seconds of the processes in
    process groups `groups` or with ids `pids`), from /proc; None elsewhere."""
    try:
        hz = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
        busy = sum(f) - f[3] - (f[4] if len(f) > 4 else 0)   # less idle and iowait
        ours = 0
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as fh:
                    st = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(st[2]) in groups or int(name) in pids:   # st[2]: pgrp
                ours += int(st[11]) + int(st[12])            # utime, stime
        return busy / hz, ours / hz
    except (OSError, ValueError, IndexError):
        return None


def connector_cost(rounds: List[Dict[str, Any]], key: str) -> List[float]:
    """Per round: the connector's lookup + load seconds of rounds[i][key]."""
    out = []
    for r in rounds:
        out.append(sum(t["dur"] for t in r[key].get("timings") or ()
                       if t.get("event") in ("lookup", "load")))
    return out


def breakdown(rounds: List[Dict[str, Any]], key: str) -> Dict[str, float]:
    """Median seconds per phase of one request, from the engine's timing lines."""
    cols: Dict[str, List[float]] = {}
    for r in rounds:
        res = r[key]
        ph: Dict[str, float] = {"ttft": res["ttft"]}
        for t in res.get("timings") or ():
            ev = t.get("event")
            if ev == "lookup":
                ph["lookup"] = ph.get("lookup", 0.0) + t["dur"]
            elif ev == "load":
                ph["load"] = ph.get("load", 0.0) + t["dur"]
                for k, v in t.items():   # the connector's own phases (ttft_connector.py)
                    if k not in ("event", "dur", "blocks", "tokens", "pid") and \
                            isinstance(v, (int, float)):
                        ph[f"load.{k}"] = ph.get(f"load.{k}", 0.0) + v
            elif ev == "step":
                ph["forward"] = ph.get("forward", 0.0) + t["forward"]
                ph["save"] = ph.get("save", 0.0) + t["save"]
        known = sum(v for k, v in ph.items() if k in ("lookup", "load", "forward", "save"))
        ph["other"] = ph["ttft"] - known
        for k, v in ph.items():
            cols.setdefault(k, []).append(v)
    return {k: round(median(v), 6) for k, v in cols.items()}


def run(quick: bool = False, log: Callable[[str], None] = lambda s: None,
        python: Optional[str] = None) -> List[Result]:
    python = python or engine_python()
    check_vllm(python)
    tmp = tempfile.mkdtemp(prefix="kvkt-", dir="/tmp")   # short: unix socket paths
    bench = Bench(Scale.for_mode(quick), log, python, tmp)
    ok = False
    try:
        out = bench.run()
        ok = True
        return out
    finally:
        bench.close()
        if ok or not os.environ.get("KVKEEPER_BENCH_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"ttft: failed; logs kept in {tmp}")
