"""Connector benchmark: time to first token of a full and a partial prefix hit.

    kvkeeper bench ttft [--json] [--quick] [--engine-python PATH]

Needs vLLM and torch, in the Python that runs the engines (--engine-python,
$KVKEEPER_BENCH_PYTHON, else this interpreter); this module itself imports
neither (and nothing the daemon imports imports it). It starts a kvkeeper
daemon (rig.py: the real daemon, shared memory, a unix socket) and four vLLM
engines, each in its own processes (engine.py, driven by driver.py), all on
the same dummy-weight Llama (model.MODEL: one layer of hidden 768, 12 heads, 12
KV heads, fp32, vocab 32000: its 2048-token prefill takes about 1 s on one core
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
busy-poll for 1 s after each step: see rig.SWITCH_SETTLE_S). The median of the
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

Results and what their params carry: ttft_results.py. About 4 minutes on a
2-core CPU (--quick: about 1 minute), half of it the engines' start-up.
"""
from __future__ import annotations

import os
import time
from typing import Any, Callable, Dict, List, Optional

from kvkeeper.server.bench.result import Result

from .driver import check_vllm, engine_python
from .model import BLOCK_TOKENS, MODEL, Prompts, kv_bytes_per_token, write_model
from .phases import cpu_seconds
from .rig import Rig, engine_args, scratch_dir
from .ttft_results import Hits, Scale, results
from .verify import expect_hits, expect_load_counters, expect_loaded_blocks, kvk_hit


class Bench:
    def __init__(self, scale: Scale, log: Callable[[str], None], python: str,
                 tmp: str) -> None:
        self.s = scale
        self.hits = Hits.of(scale)
        self.rig = Rig(tmp, log, python, "ttft")
        self.log = log
        self.tmp = tmp
        self.prompts = Prompts(MODEL["vocab_size"], seed=20240601)
        self.foreign: Optional[Dict[str, float]] = None

    # ---- set-up

    def start(self) -> None:
        model = write_model(os.path.join(self.tmp, "model"))
        storage = os.path.join(self.tmp, "example-store")
        os.makedirs(storage)
        block_bytes = kv_bytes_per_token() * BLOCK_TOKENS
        prompts_saved = 2 * (self.s.reps + self.s.warmups + 1)
        capacity = max(256 << 20, 2 * prompts_saved * (self.s.prompt_tokens // BLOCK_TOKENS + 1)
                       * block_bytes)
        url = self.rig.start_daemon(capacity)
        common = engine_args(model, self.s.in_process)
        # For A/B runs of connector settings: extra kv_connector_extra_config (JSON).
        kvk_extra = ["--extra", os.environ["KVKEEPER_BENCH_CONNECTOR_EXTRA"]] \
            if os.environ.get("KVKEEPER_BENCH_CONNECTOR_EXTRA") else []

        def kvk(name: str) -> List[str]:
            return [*common, "--connector", "kvkeeper", "--url", url, "--report",
                    "--timings", self.rig.timings_path(name), *kvk_extra]

        self.rig.start_engines({
            "recompute": [*common, "--connector", "none"],
            "kvk-a": kvk("kvk-a"),
            "kvk-b": kvk("kvk-b"),
            "example": [*common, "--connector", "example", "--storage", storage,
                        "--timings", self.rig.timings_path("example")],
        })

    def close(self) -> None:
        self.rig.close()

    # ---- one round

    def round(self) -> Dict[str, Any]:
        """Every engine once on fresh prompts; the samples of this round."""
        n, shared, hits, one = self.s.prompt_tokens, self.s.shared_tokens, self.hits, self.rig.one
        full = self.prompts.tokens(n)
        prefix = self.prompts.tokens(shared)
        src = prefix + self.prompts.tokens(n - shared)      # what kvk-a saves
        partial = prefix + self.prompts.tokens(n - shared)  # shares only the prefix
        a_full = one("kvk-a", full)
        a_src = one("kvk-a", src)
        # kvk-a sends its saves in the background: all of it is in the daemon
        # (and nothing is still being sent) before anything else is measured.
        self.rig.wait_saved([(a_full, full), (a_src, src)])
        r_full = one("recompute", full)
        r_partial = one("recompute", partial)
        b_full = one("kvk-b", full)
        b_partial = one("kvk-b", partial)
        self.rig.wait_saved([(b_partial, partial)])   # kvk-b saves the blocks it computed
        x_save = one("example", full)
        x_full = one("example", full)
        # Verify, also in warm-ups (a broken set-up fails before the long part).
        expect_hits("kvkeeper full hit (kvk-b)", [kvk_hit(b_full)], hits.full)
        expect_hits("kvkeeper partial hit (kvk-b)", [kvk_hit(b_partial)], hits.partial)
        expect_hits("kvk-a (fresh prompts, must miss)", [kvk_hit(a_full), kvk_hit(a_src)], 0)
        expect_hits("recompute (no connector, no prefix cache)",
                    [r_full["cached"], r_partial["cached"]], 0)
        expect_hits("ExampleConnector first request (saves)", [x_save["cached"]], 0)
        expect_hits("ExampleConnector full hit (num_cached_tokens)", [x_full["cached"]],
                    hits.example_full)
        expect_loaded_blocks("kvk-b", b_full, hits.full, hits.full_blocks)
        expect_loaded_blocks("kvk-b", b_partial, hits.partial, hits.partial // BLOCK_TOKENS)
        return {"recompute_full": r_full, "recompute_partial": r_partial, "kvk_full": b_full,
                "kvk_partial": b_partial, "kvk_miss": a_full, "kvk_save_src": a_src,
                "example_full": x_full, "example_save": x_save}

    def run(self) -> List[Result]:
        self.start()
        groups = [e.proc.pid for e in self.rig.engines.values()]   # each its own session
        cpu0 = cpu_seconds(groups, self.rig.pids())
        t0 = time.monotonic()
        for i in range(self.s.warmups):
            self.round()
            self.log(f"ttft: warm-up {i + 1}/{self.s.warmups} done")
        kvk_b = self.rig.engines["kvk-b"]
        before = kvk_b.metrics()
        rounds = []
        for i in range(self.s.reps):
            rounds.append(self.round())
            r = rounds[-1]
            self.log(f"ttft: repetition {i + 1}/{self.s.reps}: recompute "
                     f"{r['recompute_full']['ttft']:.3f}s, kvkeeper hit "
                     f"{r['kvk_full']['ttft'] * 1e3:.1f}ms, example hit "
                     f"{r['example_full']['ttft'] * 1e3:.1f}ms, kvkeeper partial "
                     f"{r['kvk_partial']['ttft']:.3f}s")
        after = kvk_b.metrics()
        cpu1 = cpu_seconds(groups, self.rig.pids())
        if cpu0 is not None and cpu1 is not None:
            self.foreign = {"seconds": round(time.monotonic() - t0, 1),
                            "cpu_seconds_of_other_processes": round(
                                (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1]), 1)}
        expect_load_counters("kvk-b", before, after, self.s.reps * (
            self.hits.full_blocks + self.hits.partial // BLOCK_TOKENS))
        return results(rounds, self.s, self.hits, self.foreign)


def run(quick: bool = False, log: Callable[[str], None] = lambda s: None,
        python: Optional[str] = None) -> List[Result]:
    python = python or engine_python()
    check_vllm(python)
    with scratch_dir("kvkt-", log, "ttft") as tmp:
        bench = Bench(Scale.for_mode(quick), log, python, tmp)
        try:
            return bench.run()
        finally:
            bench.close()
