"""The ttft comparison: its sizes, the hits they imply, and the results of the rounds.

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
hit measured inside the engines (ttft_connector.py, phases.py): lookup, load
(what the step waited for the loads; kvkeeper's phases: fetch = the worker's
Match with the blocks' arena refs, copy = arena -> KV cache, check = CRC32 of
the copied blocks, the last two partly beside the forward on the spare core;
layer_wait and check_wait = what the forward and the end of the step waited
for them), forward, save, and other (the rest of the TTFT: front end, IPC,
scheduling, sampling, output), plus the CPU time other processes took while
the repetitions ran (other work on the machine makes every figure noisier).
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Dict, List, Optional

from kvkeeper.server.bench.result import Result, median

from .model import BLOCK_TOKENS, MODEL, describe, kv_bytes_per_token
from .phases import breakdown, connector_cost


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


@dataclass(frozen=True)
class Hits:
    """The hit tokens (and blocks) each request of a round must report."""
    full: int           # kvkeeper, full hit
    full_blocks: int
    example_full: int   # ExampleConnector, full hit
    partial: int        # kvkeeper, partial hit

    @classmethod
    def of(cls, s: Scale) -> "Hits":
        # kvkeeper loads every full block and reports all but the last token;
        # ExampleConnector stops at the last block boundary before it.
        full = min(s.prompt_tokens // BLOCK_TOKENS * BLOCK_TOKENS, s.prompt_tokens - 1)
        return cls(full=full, full_blocks=-(-full // BLOCK_TOKENS),
                   example_full=(s.prompt_tokens - 1) // BLOCK_TOKENS * BLOCK_TOKENS,
                   partial=s.shared_tokens // BLOCK_TOKENS * BLOCK_TOKENS)


def results(rounds: List[Dict[str, Any]], s: Scale, hits: Hits,
            foreign: Optional[Dict[str, float]]) -> List[Result]:
    """The six results of `rounds` (one dict of request results per repetition)."""
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

    model = f"{describe(MODEL)}, vocab {MODEL['vocab_size']}"
    common = {"model": model, "block_tokens": BLOCK_TOKENS, "reps": s.reps,
              "warmups": s.warmups, "kv_bytes_per_token": kv_bytes_per_token(),
              "engine_processes": ("one per engine (--quick)" if s.in_process else
                                   "front end, engine core, worker (vLLM's default)"),
              "vllm_cpu_reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
              "cpus": os.cpu_count(),
              # CPU time the machine spent on processes other than this
              # benchmark's while the repetitions ran: more than a few
              # seconds means other work shared the CPUs (noisier figures)
              "repetitions_wall_and_other_cpu": foreign,
              "ttft": "vLLM first_token_latency of one request, max_tokens=1, median",
              "vllm_prefix_caching": False}
    full = {**common, "prompt_tokens": s.prompt_tokens, "hit_tokens": hits.full,
            "example_hit_tokens": hits.example_full, "hit_verified": True,
            "loaded_bytes": hits.full_blocks * BLOCK_TOKENS * kv_bytes_per_token()}
    partial = {**common, "prompt_tokens": s.prompt_tokens, "shared_prefix_tokens":
               s.shared_tokens, "hit_tokens": hits.partial, "hit_verified": True}
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
