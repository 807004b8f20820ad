"""Remote-hit benchmark: a full hit's time to first token over streams vs shared memory.

    kvkeeper bench stream-hit [--json] [--quick] [--engine-python PATH]

The remote path (`kvkeeper_transport: stream`, gRPC LoadStream over TCP, for
engines that cannot map the daemon's arena) against the same-host path
(shared memory) on the same prompt, the same engine shape, side by side. Per
model (MODELS: the ttft bench's 1-layer model, and a 6-layer GQA Llama
whose 2048-token prompt is 24 MiB of KV), one daemon (unix socket and TCP)
and three vLLM engines (engine.py, vLLM's own prefix cache off):

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
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional

from kvkeeper.server.bench.ports import free_port
from kvkeeper.server.bench.result import Result, median

from .driver import check_vllm, engine_python
from .model import BLOCK_TOKENS, M2, MODEL, Prompts, describe, kv_bytes_per_token, write_model
from .phases import breakdown
from .rig import Rig, engine_args, scratch_dir
from .verify import (VerificationError, expect_hits, expect_load_counters, expect_loaded_blocks,
                     kvk_hit)

MODELS: Dict[str, Dict[str, Any]] = {
    "ttft-1layer": MODEL,
    # The remote-hit shape of issue 10: 6 layers, GQA (12 heads, 4 KV heads),
    # 12 KiB of KV per token, 384 KiB per block.
    "gqa-6layer": M2,
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


class _ModelRun:
    def __init__(self, name: str, scale: Scale, log: Callable[[str], None], python: str,
                 tmp: str) -> None:
        self.name, self.cfg, self.s, self.log, self.tmp = name, MODELS[name], scale, log, tmp
        self.rig = Rig(tmp, log, python, f"stream-hit {name}")
        self.prompts = Prompts(self.cfg["vocab_size"], seed=20251201)
        self.hit = scale.prompt_tokens - 1          # every full block, less the last token
        self.hit_blocks = -(-self.hit // BLOCK_TOKENS)

    def start(self) -> None:
        model = write_model(os.path.join(self.tmp, "model"), self.cfg)
        block_bytes = kv_bytes_per_token(self.cfg) * BLOCK_TOKENS
        prompts = self.s.reps + self.s.warmups + 1
        capacity = max(256 << 20, 2 * prompts * (self.s.prompt_tokens // BLOCK_TOKENS + 1)
                       * block_bytes)
        tcp = f"127.0.0.1:{free_port()}"
        url = self.rig.start_daemon(capacity, tcp=tcp)
        common = [*engine_args(model, self.s.in_process), "--connector", "kvkeeper", "--report"]
        extra = json.loads(os.environ.get("KVKEEPER_BENCH_CONNECTOR_EXTRA") or "{}")

        def args(name: str, url: str, transport: str) -> List[str]:
            return [*common, "--url", url, "--timings", self.rig.timings_path(name),
                    "--extra", json.dumps({**extra, "kvkeeper_transport": transport})]

        self.rig.start_engines({"kvk-a": args("kvk-a", url, "shm"),
                                "kvk-shm": args("kvk-shm", url, "shm"),
                                "kvk-stream": args("kvk-stream", tcp, "stream")})

    def close(self) -> None:
        self.rig.close()

    def round(self, rep: int) -> Dict[str, Any]:
        prompt = self.prompts.tokens(self.s.prompt_tokens)
        saved = self.rig.one("kvk-a", prompt)
        expect_hits("kvk-a (fresh prompt, must miss)", [kvk_hit(saved)], 0)
        self.rig.wait_saved([(saved, prompt)])
        order = ["kvk-shm", "kvk-stream"] if rep % 2 == 0 else ["kvk-stream", "kvk-shm"]
        out = {name: self.rig.one(name, prompt) for name in order}
        for name, res in out.items():
            expect_hits(f"{name} full hit", [kvk_hit(res)], self.hit)
            expect_loaded_blocks(name, res, self.hit, self.hit_blocks)
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
        loaders = {n: self.rig.engines[n] for n in ("kvk-shm", "kvk-stream")}
        before = {n: e.metrics() for n, e in loaders.items()}
        rounds = []
        for i in range(self.s.reps):
            r = self.round(i)
            rounds.append(r)
            self.log(f"stream-hit {self.name}: repetition {i + 1}/{self.s.reps}: shm "
                     f"{r['kvk-shm']['ttft'] * 1e3:.1f}ms, stream "
                     f"{r['kvk-stream']['ttft'] * 1e3:.1f}ms")
        for n, e in loaders.items():
            expect_load_counters(n, before[n], e.metrics(), self.s.reps * self.hit_blocks)
        shm = [r["kvk-shm"]["ttft"] for r in rounds]
        stream = [r["kvk-stream"]["ttft"] for r in rounds]
        c = self.cfg
        return Result(
            name=f"stream_hit.{self.name}.full_hit.stream_vs_shm", value=median(stream), unit="s",
            baseline_name="the same full hit over shared memory (kvkeeper_transport shm)",
            baseline_value=median(shm), better="lower", target="<= 1.5",
            params={"model": describe(c),
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
        with scratch_dir("kvks-", log, "stream-hit") as tmp:
            m = _ModelRun(name, scale, log, python, tmp)
            try:
                out.append(m.run())
            finally:
                m.close()
    return out
