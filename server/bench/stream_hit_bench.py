"""Remote-hit benchmark: a full hit's time to first token over streams vs shared memory.

    kvkeeper bench stream-hit [--json] [--quick] [--engine-python PATH]

The remote path (`kvkeeper_transport: stream`, gRPC LoadStream over TCP, for
engines that cannot map the daemon's arena) against the same-host path
(shared memory) on the same prompt, the same engine shape, side by side. Per
model (MODELS: the ttft bench's 1-layer model, and a 6-layer GQA Llama
whose 2048-token prompt is 24 MiB of KV), one daemon (unix socket and TCP)
and three vLLM engines (ttft_engine.py, vLLM's own prefix cache off):

  kvk-a       computes each fresh prompt and saves it (unix socket, shm)
  kvk-shm     loads it: kvkeeper_transport shm, over the unix socket
  kvk-stream  loads it: kvkeeper_transport stream, over TCP 127.0.0.1

After a first round that is repeated until both loaders hit (a connector
whose first connection timed out serves uncached until it reconnects), each
repetition sends a fresh 2048-token prompt (512 with --quick) to kvk-a,
waits until the daemon holds all of it, then has kvk-shm and kvk-stream load
it (alternating which goes first), each request after the ttft bench's
pauses. Every hit is verified or the benchmark fails: both loaders must
report the whole prompt less the last token as hit tokens, their workers
must have loaded every block, and their counters must show no load or
checksum error. Engines run vLLM's usual process layout (one process each
with --quick), the same CPU reservation as the ttft bench.

Results (seconds, median of the repetitions; ratio = stream / shm):

  stream_hit.<model>.full_hit.stream_vs_shm    target <= 1.5 (issue 10)

params carry every sample and both loaders' median breakdowns
(ttft_connector.py; load.fetch is the worker's whole load before the
forward; over shm load.copy/load.check the copies and checks; over streams
load.stream the LoadStream with its copies and checks, load.stream_first the
wait for its first chunk, load.stream_copy the copying and checking). KVKEEPER_BENCH_STREAM_MODELS (comma-separated
names of MODELS) picks the models; KVKEEPER_BENCH_CONNECTOR_EXTRA (JSON)
adds kv_connector_extra_config to every kvkeeper engine, for A/B runs.
"""
from __future__ import annotations

import json
import os
import shutil
import socket
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from .result import Result, median
from .servers import ServerProcess
from .ttft_bench import (BLOCK_TOKENS, MAX_MODEL_LEN, MODEL, SETTLE_S, SWITCH_SETTLE_S, Engine,
                         Prompts, VerificationError, breakdown, check_vllm, engine_python,
                         expect_hits, kvk_hit, kv_bytes_per_token)

MODELS: Dict[str, Dict[str, Any]] = {
    "ttft-1layer": MODEL,
    # The remote-hit shape of issue 10: 6 layers, GQA (12 heads, 4 KV heads),
    # 12 KiB of KV per token, 384 KiB per block.
    "gqa-6layer": {**MODEL, "num_hidden_layers": 6, "num_key_value_heads": 4,
                   "intermediate_size": 2048, "vocab_size": 8192},
}
MODELS_ENV = "KVKEEPER_BENCH_STREAM_MODELS"
READY_ROUNDS = 5


@dataclass(frozen=True)
class Scale:
    prompt_tokens: int
    reps: int
    warmups: int
    in_process: bool
    models: tuple

    @classmethod
    def for_mode(cls, quick: bool) -> "Scale":
        names = [m for m in (os.environ.get(MODELS_ENV) or "").split(",") if m]
        unknown = [m for m in names if m not in MODELS]
        if unknown:
            raise ValueError(f"${MODELS_ENV}: unknown model(s) {unknown}; known: {list(MODELS)}")
        if quick:
            return cls(prompt_tokens=512, reps=3, warmups=1, in_process=True,
                       models=tuple(names or ["ttft-1layer"]))
        return cls(prompt_tokens=2048, reps=7, warmups=2, in_process=False,
                   models=tuple(names or list(MODELS)))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class _ModelRun:
    def __init__(self, name: str, scale: Scale, log: Callable[[str], None], python: str,
                 tmp: str) -> None:
        self.name, self.cfg, self.s, self.log, self.python, self.tmp = (
            name, MODELS[name], scale, log, python, tmp)
        self.prompts = Prompts(self.cfg["vocab_size"], seed=20251201)
        self.hit = scale.prompt_tokens - 1          # every full block, less the last token
        self.hit_blocks = -(-self.hit // BLOCK_TOKENS)
        self.daemon: Optional[ServerProcess] = None
        self.engines: Dict[str, Engine] = {}
        self.client: Any = None
        self.last = ""

    def start(self) -> None:
        model = os.path.join(self.tmp, "model")
        os.makedirs(model)
        with open(os.path.join(model, "config.json"), "w") as fh:
            json.dump(self.cfg, fh)
        block_bytes = kv_bytes_per_token(self.cfg) * BLOCK_TOKENS
        prompts = self.s.reps + self.s.warmups + 1
        capacity = max(256 << 20, 2 * prompts * (self.s.prompt_tokens // BLOCK_TOKENS + 1)
                       * block_bytes)
        tcp = f"127.0.0.1:{_free_port()}"
        self.daemon = ServerProcess.kvkeeper(self.tmp, capacity=capacity, page_bytes=64 << 10,
                                             tcp=tcp)
        self.daemon.start()
        env = dict(os.environ)
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
        env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")   # as the ttft bench (see there)
        common = ["--model", model, "--block-size", str(BLOCK_TOKENS),
                  "--max-model-len", str(MAX_MODEL_LEN), "--connector", "kvkeeper"]
        if self.s.in_process:
            common.append("--in-process")
        extra = json.loads(os.environ.get("KVKEEPER_BENCH_CONNECTOR_EXTRA") or "{}")

        def args(name: str, url: str, transport: str) -> List[str]:
            return ["--url", url, "--timings", os.path.join(self.tmp, f"timings-{name}.jsonl"),
                    "--extra", json.dumps({**extra, "kvkeeper_transport": transport})]

        specs = {"kvk-a": args("kvk-a", self.daemon.url, "shm"),
                 "kvk-shm": args("kvk-shm", self.daemon.url, "shm"),
                 "kvk-stream": args("kvk-stream", tcp, "stream")}
        t0 = time.perf_counter()
        for name, a in specs.items():
            self.engines[name] = Engine(name, self.python, common + a,
                                        os.path.join(self.tmp, f"engine-{name}.log"), env)
        with ThreadPoolExecutor(len(specs)) as pool:
            for f in [pool.submit(e.wait_ready) for e in self.engines.values()]:
                f.result()
        self.log(f"stream-hit {self.name}: engines ready in {time.perf_counter() - t0:.0f}s")

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

    def one(self, engine: str, prompt: List[int]) -> Dict[str, Any]:
        settle = SETTLE_S if engine == self.last else SWITCH_SETTLE_S
        self.last = engine
        return self.engines[engine].one(prompt, settle=settle)

    def wait_saved(self, res: Dict[str, Any], tokens: List[int], timeout: float = 60.0) -> None:
        from kvkeeper.client import Client
        from kvkeeper.connector.keys import chain_keys

        info = res["params"]["kvkeeper"]
        if self.client is None:
            assert self.daemon is not None
            self.client = Client.connect(self.daemon.url, info["namespace"],
                                         instance_id="kvkeeper bench stream-hit", timeout=5.0)
        keys = chain_keys(bytes.fromhex(info["seed"]), list(tokens), int(info["block_tokens"]))
        deadline = time.monotonic() + timeout
        while self.client.match(keys).matched < len(keys):
            if time.monotonic() > deadline:
                raise VerificationError(f"the daemon did not hold all {len(keys)} blocks of a "
                                        f"prompt within {timeout:.0f} s")
            time.sleep(0.02)

    def round(self, rep: int) -> Dict[str, Any]:
        prompt = self.prompts.tokens(self.s.prompt_tokens)
        saved = self.one("kvk-a", prompt)
        expect_hits("kvk-a (fresh prompt, must miss)", [kvk_hit(saved)], 0)
        self.wait_saved(saved, prompt)
        order = ["kvk-shm", "kvk-stream"] if rep % 2 == 0 else ["kvk-stream", "kvk-shm"]
        out = {name: self.one(name, prompt) for name in order}
        for name, res in out.items():
            expect_hits(f"{name} full hit", [kvk_hit(res)], self.hit)
            blocks = sum(t["blocks"] for t in res["timings"] if t.get("event") == "load")
            if blocks != self.hit_blocks:
                raise VerificationError(f"{name}'s worker loaded {blocks} blocks for a hit of "
                                        f"{self.hit} tokens; expected {self.hit_blocks}")
        return out

    def run(self) -> Result:
        self.start()
        # On a loaded machine a connector's first connection can time out and
        # back off (it then serves uncached): warm up until both loaders hit.
        for attempt in range(READY_ROUNDS):
            try:
                self.round(0)
                break
            except VerificationError as e:
                if attempt == READY_ROUNDS - 1:
                    raise
                self.log(f"stream-hit {self.name}: not ready yet ({e}); again")
                time.sleep(2.0)
        for i in range(self.s.warmups):
            self.round(i)
        before = {n: self.engines[n].metrics() for n in ("kvk-shm", "kvk-stream")}
        rounds = []
        for i in range(self.s.reps):
            r = self.round(i)
            rounds.append(r)
            self.log(f"stream-hit {self.name}: repetition {i + 1}/{self.s.reps}: shm "
                     f"{r['kvk-shm']['ttft'] * 1e3:.1f}ms, stream "
                     f"{r['kvk-stream']['ttft'] * 1e3:.1f}ms")
        for n, m0 in before.items():
            m1 = self.engines[n].metrics()

            def delta(key: str) -> float:
                k = f"vllm:kvkeeper_{key}"
                return m1.get(k, 0) - m0.get(k, 0)

            want = self.s.reps * self.hit_blocks
            if delta("loaded_blocks") != want or delta("load_error_blocks") \
                    or delta("checksum_errors"):
                raise VerificationError(
                    f"{n}'s counters: loaded_blocks +{delta('loaded_blocks'):.0f} (expected "
                    f"+{want}), load_error_blocks +{delta('load_error_blocks'):.0f}, "
                    f"checksum_errors +{delta('checksum_errors'):.0f}")
        shm = [r["kvk-shm"]["ttft"] for r in rounds]
        stream = [r["kvk-stream"]["ttft"] for r in rounds]
        c = self.cfg
        return Result(
            name=f"stream_hit.{self.name}.full_hit.stream_vs_shm", value=median(stream), unit="s",
            baseline_name="the same full hit over shared memory (kvkeeper_transport shm)",
            baseline_value=median(shm), better="lower", target="<= 1.5",
            params={"model": (f"dummy Llama, {c['num_hidden_layers']} layer(s), hidden "
                              f"{c['hidden_size']}, {c['num_attention_heads']} heads / "
                              f"{c['num_key_value_heads']} KV heads, {c['torch_dtype']}"),
                    "prompt_tokens": self.s.prompt_tokens, "hit_tokens": self.hit,
                    "hit_verified": True, "block_tokens": BLOCK_TOKENS,
                    "loaded_bytes": self.hit_blocks * BLOCK_TOKENS * kv_bytes_per_token(c),
                    "reps": self.s.reps, "warmups": self.s.warmups,
                    "engine_processes": "one per engine" if self.s.in_process else
                    "front end, engine core, worker (vLLM's default)",
                    "stream_url": "TCP 127.0.0.1", "shm_url": "unix socket",
                    "samples": [round(x, 5) for x in stream],
                    "baseline_samples": [round(x, 5) for x in shm],
                    "stream_breakdown_s": breakdown(rounds, "kvk-stream"),
                    "shm_breakdown_s": breakdown(rounds, "kvk-shm")},
            note="vLLM first_token_latency of one request, max_tokens=1; the loaders are "
                 "separate engines from the one that saved")


def run(quick: bool = False, log: Callable[[str], None] = lambda s: None,
        python: Optional[str] = None) -> List[Result]:
    python = python or engine_python()
    check_vllm(python)
    scale = Scale.for_mode(quick)
    out = []
    for name in scale.models:
        tmp = tempfile.mkdtemp(prefix="kvks-", dir="/tmp")   # short: unix socket paths
        m = _ModelRun(name, scale, log, python, tmp)
        ok = False
        try:
            out.append(m.run())
            ok = True
        finally:
            m.close()
            if ok or not os.environ.get("KVKEEPER_BENCH_KEEP"):
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                log(f"stream-hit: failed; logs kept in {tmp}")
    return out
