"""Connector benchmark: time to first token of full and partial prefix hits, on a model matrix.

    kvkeeper bench ttft [--json] [--quick] [--model CONFIG.json ...] [--engine-python PATH]

Needs vLLM and torch, in the Python that runs the engines (--engine-python,
$KVKEEPER_BENCH_PYTHON, else this interpreter); this module itself imports
neither (and nothing the daemon imports imports it). Per model of the matrix
(ttft_matrix.py: M1, a one-layer model, at 2048 tokens; M2, a 6-layer GQA
Llama, at 2048 and 4096; or --model configs) it starts a kvkeeper daemon
(rig.py: the real daemon, shared memory, a unix socket) and six vLLM
engines, each in its own processes (engine.py, driven by driver.py), on
dummy weights, blocks of 32 tokens, vLLM's own prefix caching off except in
`prefix`:

  recompute  no connector: every prompt is computed
  kvk-a      KVKeeperConnector: computes prompts and saves them to the daemon
  kvk-b      KVKeeperConnector: loads what kvk-a saved (another process, as
             another vLLM instance would)
  example    vLLM's in-tree ExampleConnector (safetensors files in a local
             directory, here in the page cache): each prompt is sent twice,
             the first saves it, the second (measured) loads it
  peer       KVKeeperConnector with kvkeeper_peer (as kvk-a): loads a prompt
             only kvk-a's KV cache holds, straight from kvk-a's shared
             memory (a same-host peer hit, issue 14), and a host-tier hit
  prefix     no connector, vLLM's prefix caching on: THE FLOOR. It serves a
             prompt, then is asked for that prompt plus the token it
             generated: the KV is resident, nothing is loaded, one token is
             computed. Then the partial-hit prompt: vLLM's own hit on the
             same shared part that kvk-b loads.

Every engine gets the same VLLM_CPU_NUM_OF_RESERVED_CPU (default 1: vLLM
would otherwise give connector engines every core of a 2-core machine and
the others one). --quick runs each engine in a single process
(VLLM_ENABLE_V1_MULTIPROCESSING=0), which starts three times faster; the full
run keeps vLLM's usual layout (front end, engine core, worker). Only one
model's engines are alive at a time, and one request runs at a time (the
other engines idle).

TTFT is vLLM's per-request first_token_latency (arrival to first token, as
the front end sees it) of one request at a time with max_tokens=1. Each
repetition uses fresh random prompts and runs every engine in turn (so noise
from the machine hits all of them alike), each request after a pause: 0.25 s
within an engine, for earlier requests' background work (saves, releases)
to end, 1.3 s when the previous request ran on another engine (vLLM's worker
and engine core busy-poll for 1 s after each step: rig.SWITCH_SETTLE_S) and
before every timed request, so that each timed request, the floor's and
ExampleConnector's as kvkeeper's, starts with every engine idle (one that
finds its own engine still spinning is ~2 ms faster: rig.py).
Medians and p90 of the repetitions (9; --quick 2) are reported, after
untimed warm-ups. Per repetition, with a prompt of N tokens:

  full hit     kvk-a computes and saves the prompt; recompute computes it;
               kvk-b loads all N/32 blocks, reports N-1 hit tokens and
               computes the last token only (vLLM always computes it);
               example saves it, then loads N-32 tokens and computes 32;
               prefix serves another N-token prompt, then that prompt plus
               one token (N cached tokens, one computed)
  partial hit  a prefix of 75% of N shared with a prompt kvk-a saved and
               prefix served, plus new tokens: recompute computes all of it,
               kvk-b loads the prefix and computes the rest, prefix takes
               the prefix from its own cache and computes the rest

  peer hit     first in a round: kvk-a computes a prompt, the daemon's host
               tier drops it (admin Evict), so only kvk-a's cache holds it;
               engine peer loads all its blocks from there (hit sources:
               p2p), with kvk-a's greedy token; at the end of the round the
               same engine has a host-tier full hit of kvk-a's other prompt

Both recompute requests of a repetition are fresh prompts of the same length
on the same engine, so every recompute baseline is the median of both.

Every hit is verified (ttft_checks.py): kvk-b's per-request report
(kv_transfer_params["kvkeeper"]["hit_tokens"]), its worker's loaded blocks
and its counters (loaded blocks, no load or checksum errors) must show the
whole hit loaded, and its greedy tokens must equal recompute's on the same
prompt; example's second request and prefix's hits must report the hit as
cached tokens; recompute, kvk-a and the first requests of example and
prefix must report none. A failed check in a warm-up stops the benchmark;
in a timed repetition it fails every target of the case (and the case's
verification.failed_checks result). vLLM's own hits' greedy tokens are
compared with recompute's and reported (ttft_results.py).

Results and what their params carry: ttft_results.py. The full matrix takes
about 60 minutes on a 2-core CPU (--quick: about 3 minutes).
"""
from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvkeeper.server.bench.result import Result, render_table

from .driver import check_vllm, engine_python
from .model import BLOCK_TOKENS, Prompts, kv_bytes_per_token, write_model
from .phases import cpu_seconds
from .rig import Rig, engine_args, scratch_dir
from .ttft_matrix import Case, Hits, ModelRun, Scale, matrix
from .ttft_results import results
from .ttft_checks import Checks, check_round, fail_results
from .verify import VerificationError, load_counters_problem

# Prompts the daemon must hold at once: a round saves three (kvk-a's two,
# kvk-b's partial); the arena holds a few rounds' worth and evicts the rest.
ARENA_PROMPTS = 8


class Bench:
    """One model of the matrix: a daemon and six engines, then each of its lengths."""

    def __init__(self, run: ModelRun, scale: Scale, log: Callable[[str], None], python: str,
                 tmp: str) -> None:
        self.m = run
        self.s = scale
        self.rig = Rig(tmp, log, python, "ttft")
        self.log = log
        self.tmp = tmp
        self.prompts = Prompts(run.cfg["vocab_size"], seed=20240601)

    # ---- set-up

    def start(self) -> None:
        model = write_model(os.path.join(self.tmp, "model"), self.m.cfg)
        storage = os.path.join(self.tmp, "example-store")
        os.makedirs(storage)
        block_bytes = kv_bytes_per_token(self.m.cfg) * BLOCK_TOKENS
        capacity = max(256 << 20, ARENA_PROMPTS * (max(self.m.lengths) // BLOCK_TOKENS + 1)
                       * block_bytes)
        url = self.rig.start_daemon(capacity)
        common = engine_args(model, self.s.in_process, self.m.max_model_len)
        # For A/B runs of connector settings: extra kv_connector_extra_config (JSON).
        extra = json.loads(os.environ.get("KVKEEPER_BENCH_CONNECTOR_EXTRA") or "{}")

        def kvk(name: str, peer: bool = False) -> List[str]:
            more = {**extra, "kvkeeper_peer": True} if peer else extra
            return [*common, "--connector", "kvkeeper", "--url", url, "--report",
                    "--timings", self.rig.timings_path(name),
                    *(["--extra", json.dumps(more)] if more else [])]

        self.rig.start_engines({
            "recompute": [*common, "--connector", "none"],
            # kvk-a also holds the peer case's prompt in its KV cache (in
            # shared memory): it is only ever timed on misses
            "kvk-a": kvk("kvk-a", peer=True),
            "kvk-b": kvk("kvk-b"),
            "peer": kvk("peer", peer=True),
            "example": [*common, "--connector", "example", "--storage", storage,
                        "--timings", self.rig.timings_path("example")],
            "prefix": [*common, "--connector", "none", "--prefix-caching"],
        })

    def close(self) -> None:
        self.rig.close()

    # ---- one round

    def round(self, case: Case, hits: Hits) -> Dict[str, Any]:
        """Every engine once on fresh prompts of `case`; the samples of this round."""
        n, shared, one, p = case.prompt_tokens, case.shared_tokens, self.rig.one, self.prompts

        def timed(engine: str, prompt: List[int]) -> Dict[str, Any]:
            return one(engine, prompt, timed=True)   # every engine idle first (rig.py)

        full = p.tokens(n)
        prefix = p.tokens(shared)
        src = prefix + p.tokens(n - shared)      # what kvk-a saves and prefix serves
        partial = prefix + p.tokens(n - shared)  # shares only the prefix
        served = p.tokens(n)                     # prefix's floor prompt
        self.rig.evict_all()   # the earlier rounds' blocks: see Rig.evict_all
        # The peer case first, before kvk-a computes anything else: kvk-a
        # computes a prompt, the daemon's host tier then drops it (what a
        # host tier too small to keep it does), so only kvk-a's KV cache
        # holds it, and engine peer copies it from there.
        held = p.tokens(n)
        a_held = one("kvk-a", held)
        self.rig.wait_saved([(a_held, held)])
        self.rig.evict_all()
        self.rig.wait_held_by_peer(a_held, held)
        peer_full = timed("peer", held)
        a_full = one("kvk-a", full)
        a_src = one("kvk-a", src)
        # kvk-a sends its saves in the background: all of it is in the daemon
        # (and nothing is still being sent) before anything else is measured.
        self.rig.wait_saved([(a_full, full), (a_src, src)])
        r_full = timed("recompute", full)
        r_partial = timed("recompute", partial)
        b_full = timed("kvk-b", full)
        b_partial = timed("kvk-b", partial)
        self.rig.wait_saved([(b_partial, partial)])   # kvk-b saves the blocks it computed
        x_save = one("example", full)
        x_full = timed("example", full)
        p_served = one("prefix", served)
        p_src = one("prefix", src)
        p_floor = timed("prefix", served + p_served["tokens"][:1])
        p_partial = timed("prefix", partial)
        peer_host = timed("peer", full)   # the same engine's host-tier hit
        return {"peer_full": peer_full, "peer_host": peer_host, "peer_src": a_held,
                "recompute_full": r_full, "recompute_partial": r_partial, "kvk_full": b_full,
                "kvk_partial": b_partial, "kvk_miss": a_full, "kvk_save_src": a_src,
                "example_full": x_full, "example_save": x_save, "prefix_floor": p_floor,
                "prefix_partial": p_partial, "prefix_served": p_served, "prefix_src": p_src}

    def run_case(self, case: Case) -> List[Result]:
        hits = Hits.of(case)
        for i in range(self.s.warmups):
            # Verified too: a broken set-up fails before the long part.
            problems = check_round(self.round(case, hits), hits).problems
            if problems:
                raise VerificationError(f"ttft {case.name}, warm-up {i + 1}: "
                                        + "; ".join(problems))
            self.log(f"ttft {case.name}: warm-up {i + 1}/{self.s.warmups} done")
        checks = Checks()
        groups = [e.proc.pid for e in self.rig.engines.values()]   # each its own session
        kvk_b = self.rig.engines["kvk-b"]
        before = kvk_b.metrics()
        cpu0, t0 = cpu_seconds(groups, self.rig.pids()), time.monotonic()
        rounds = []
        for i in range(self.s.reps):
            rounds.append(self.round(case, hits))
            r = rounds[-1]
            got = check_round(r, hits)
            checks.extend(got)
            for problem in got.problems:
                self.log(f"ttft {case.name}: repetition {i + 1}: VERIFICATION FAILED: {problem}")
            self.log(f"ttft {case.name}: repetition {i + 1}/{self.s.reps}: recompute "
                     f"{r['recompute_full']['ttft']:.3f}s, floor "
                     f"{r['prefix_floor']['ttft'] * 1e3:.1f}ms, kvkeeper hit "
                     f"{r['kvk_full']['ttft'] * 1e3:.1f}ms, example hit "
                     f"{r['example_full']['ttft'] * 1e3:.1f}ms, kvkeeper partial "
                     f"{r['kvk_partial']['ttft']:.3f}s, vLLM partial "
                     f"{r['prefix_partial']['ttft']:.3f}s")
        cpu1, wall = cpu_seconds(groups, self.rig.pids()), time.monotonic() - t0
        after = kvk_b.metrics()
        checks.add(load_counters_problem("kvk-b", before, after, self.s.reps * (
            hits.full_blocks + hits.partial // BLOCK_TOKENS)))
        return fail_results(results(rounds, case, self.s, hits, machine_load(cpu0, cpu1, wall)),
                            checks, case.name)

    def run(self) -> List[Result]:
        self.start()
        out: List[Result] = []
        for n in self.m.lengths:
            case = Case(self.m, n)
            done = self.run_case(case)
            out += done
            # each case's table as soon as it is done: a long matrix shows
            # its figures as it goes (and keeps them if stopped later)
            self.log(f"ttft {case.name}:\n" + render_table(done))
        return out


def machine_load(cpu0: Optional[Tuple[float, float]], cpu1: Optional[Tuple[float, float]],
                 wall: float) -> Optional[Dict[str, float]]:
    """What other processes took of the machine while the repetitions ran
    (more than a few CPU seconds: other work shared the CPUs, noisier figures)."""
    if cpu0 is None or cpu1 is None:
        return None
    other = (cpu1[0] - cpu0[0]) - (cpu1[1] - cpu0[1])
    return {"seconds": round(wall, 1), "cpu_seconds_of_other_processes": round(other, 1),
            "other_processes_share_of_cpus": round(other / (wall * (os.cpu_count() or 1)), 3)
            if wall > 0 else 0.0,
            "loadavg_1m_at_end": round(os.getloadavg()[0], 2)}


def run(quick: bool = False, log: Callable[[str], None] = lambda s: None,
        python: Optional[str] = None, models: Optional[Sequence[str]] = None) -> List[Result]:
    runs = matrix(quick, models, log)   # a bad --model fails before any engine starts
    python = python or engine_python()
    check_vllm(python)
    out: List[Result] = []
    failed: List[str] = []
    for m in runs:   # one model's engines at a time
        with scratch_dir(f"kvkt-{m.label}-", log, "ttft") as tmp:
            bench = Bench(m, Scale.for_mode(quick), log, python, tmp)
            try:
                out += bench.run()
            except VerificationError as e:
                # One model's set-up that cannot be measured (e.g. a baseline
                # that is not the hit it should be) does not cost the others
                # their figures: they run, and the run still fails at the end.
                log(f"ttft {m.label}: NOT MEASURED: {e}")
                failed.append(f"{m.label} ({m.source}): {e}")
            finally:
                bench.close()
    if failed:
        if out:
            log("ttft: results of the models measured:\n" + render_table(out))
        raise VerificationError("; ".join(failed))
    return out
