"""The results of one case of the ttft matrix (one model, one prompt length).

Names are ttft.<model>.<tokens>.<what> (model: m1, m2 or a --model label;
ttft_matrix.py). Seconds; ratio = value / baseline; medians of the
repetitions (p90 in params beside every median):

  full_hit.kvkeeper_vs_floor                   target <= 1.15 (issue 12; moonshot 1.05)
        the floor: vLLM's own prefix cache with the KV resident, the served
        prompt asked again plus one token (nothing loaded, one token computed)
  full_hit.kvkeeper_vs_example_connector       target <= 0.7
  full_hit.kvkeeper_p90_vs_median              target <= 1.3 (value: the p90 of
        the kvkeeper full hit, baseline: its median)
  partial_hit.kvkeeper_vs_vllm_prefix_cache    target <= 1.1: 75% shared, against
        vLLM's own cache hit on the same shared part of the same prompt
  verification.failed_checks                   target <= 0 (the value): the checks
        of every timed repetition that failed (ttft_checks.py); any fails
        every target of the case
  full_hit.kvkeeper_vs_recompute               informational
  floor.vllm_prefix_cache_vs_recompute         informational
  full_hit.example_connector_vs_recompute      informational
  partial_hit.kvkeeper_vs_recompute            informational
  miss.kvkeeper_vs_recompute                   informational: kvk-a on fresh
        prompts (a lookup that misses, the prefill, copying the new blocks out)
  full_hit.connector_cost.kvkeeper_vs_example_connector  informational: what
        each connector spends of a full hit (the scheduler's lookup and the
        worker's load before the forward pass)
  full_hit.peer_vs_host                        informational: a full hit copied
        from a same-host peer's KV cache (engine peer from kvk-a's shared
        memory; nothing in the host tier) against the same engine's host-tier
        hit (issue 14)
  full_hit.peer_vs_recompute                   informational

params carry every sample, the verified hit, the greedy tokens compared with
recompute, the median breakdown of a hit measured inside the engines
(ttft_connector.py, phases.py: lookup, load and its phases, forward, save,
other), and the machine load while the case's repetitions ran (CPU seconds of
processes other than this benchmark's: other work makes every figure noisier).
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional

from kvkeeper.server.bench.result import Result, median, percentile

from .model import BLOCK_TOKENS, describe, kv_bytes_per_token
from .phases import breakdown, connector_cost
from .ttft_matrix import Case, Hits, Scale

# (request key, request key it must produce the same greedy token as)
SAME_TOKENS = (("kvk_full", "recompute_full"), ("example_full", "recompute_full"),
               ("kvk_partial", "recompute_partial"), ("prefix_partial", "recompute_partial"))


def tokens_identical(rounds: List[Dict[str, Any]]) -> Dict[str, str]:
    """Per hit: in how many rounds its greedy tokens equal recompute's on the
    same prompt (required of kvkeeper's hits: ttft_checks.py; reported for
    vLLM's own)."""
    return {hit: f"{sum(r[hit]['tokens'] == r[ref]['tokens'] for r in rounds)}/{len(rounds)}"
            for hit, ref in SAME_TOKENS}


def results(rounds: List[Dict[str, Any]], case: Case, s: Scale, hits: Hits,
            load: Optional[Dict[str, float]]) -> List[Result]:
    """The results of `rounds` (one dict of request results per repetition)."""
    def ttfts(key: str) -> List[float]:
        return [r[key]["ttft"] for r in rounds]

    def stats(xs: List[float]) -> Dict[str, Any]:
        return {"median": round(median(xs), 6), "p90": round(percentile(xs, 90), 6),
                "samples": [round(x, 5) for x in xs]}

    # Both recompute requests of a round are fresh prompts of the same
    # length on the same engine: one pool of 2 x reps samples for every
    # recompute baseline.
    recompute = ttfts("recompute_full") + ttfts("recompute_partial")
    n, cfg = case.prompt_tokens, case.model.cfg
    common = {"case": case.name, "model": f"{describe(cfg)}, vocab {cfg['vocab_size']}",
              "model_source": case.model.source, "prompt_tokens": n,
              "block_tokens": BLOCK_TOKENS, "reps": s.reps, "warmups": s.warmups,
              "kv_bytes_per_token": kv_bytes_per_token(cfg),
              "engine_processes": ("one per engine (--quick)" if s.in_process else
                                   "front end, engine core, worker (vLLM's default)"),
              "vllm_cpu_reserved_cpus": os.environ.get("VLLM_CPU_NUM_OF_RESERVED_CPU", "1"),
              "cpus": os.cpu_count(), "machine_load": load,
              "ttft": "vLLM first_token_latency of one request, max_tokens=1",
              "greedy_tokens_identical_to_recompute":
                  tokens_identical(rounds)}
    full = {**common, "hit_tokens": hits.full, "example_hit_tokens": hits.example_full,
            "floor_hit_tokens": hits.floor,
            "loaded_bytes": hits.full_blocks * BLOCK_TOKENS * kv_bytes_per_token(cfg)}
    partial = {**common, "shared_prefix_tokens": case.shared_tokens,
               "hit_tokens": hits.partial, "vllm_prefix_cache_hit_tokens": hits.partial}
    kvk_bd = breakdown(rounds, "kvk_full")
    pre = f"ttft.{case.name}."

    def res(name: str, key: str, base: List[float], base_name: str, params: Dict[str, Any],
            target: Optional[str] = None, note: str = "") -> Result:
        v, b = stats(ttfts(key)), stats(base)
        return Result(name=pre + name, value=v["median"], unit="s", baseline_name=base_name,
                      baseline_value=b["median"], better="lower", target=target,
                      params={**params, "p90": v["p90"], "samples": v["samples"],
                              "baseline_p90": b["p90"], "baseline_samples": b["samples"]},
                      note=note)

    floor_name = ("vLLM's own prefix-cache hit, KV resident (the served prompt plus one "
                  "token: nothing loaded, one token computed)")
    rec_name = f"recompute of the {n}-token prompt (no cache)"
    k = stats(ttfts("kvk_full"))
    out = [
        res("full_hit.kvkeeper_vs_floor", "kvk_full", ttfts("prefix_floor"), floor_name,
            {**full, "kvkeeper_breakdown_s": kvk_bd,
             "floor_breakdown_s": breakdown(rounds, "prefix_floor")}, "<= 1.15",
            "engine kvk-b loads what engine kvk-a saved (another process); the floor is a "
            "third engine with vLLM's prefix caching on (moonshot: 1.05)"),
        res("full_hit.kvkeeper_vs_example_connector", "kvk_full", ttfts("example_full"),
            "vLLM ExampleConnector full hit (safetensors files, local dir)",
            {**full, "kvkeeper_breakdown_s": kvk_bd,
             "example_breakdown_s": breakdown(rounds, "example_full")}, "<= 0.7",
            "ExampleConnector saves with a first request of the prompt and loads with the "
            "second, in one engine"),
        Result(name=pre + "full_hit.kvkeeper_p90_vs_median", value=k["p90"], unit="s",
               baseline_name="median of the same kvkeeper full hits",
               baseline_value=k["median"], better="lower", target="<= 1.3",
               params={**full, "samples": k["samples"]},
               note="the spread of the kvkeeper full hit: steady, not lucky"),
        res("partial_hit.kvkeeper_vs_vllm_prefix_cache", "kvk_partial",
            ttfts("prefix_partial"),
            f"vLLM's own prefix-cache hit on the same {case.shared_tokens} shared tokens",
            {**partial, "kvkeeper_breakdown_s": breakdown(rounds, "kvk_partial")}, "<= 1.1",
            f"{case.shared_tokens} tokens shared with a prompt served before, "
            f"{n - case.shared_tokens} new, the same prompt on both engines"),
        res("full_hit.kvkeeper_vs_recompute", "kvk_full", recompute, rec_name, full),
        res("floor.vllm_prefix_cache_vs_recompute", "prefix_floor", recompute, rec_name,
            full, note=floor_name),
        res("full_hit.example_connector_vs_recompute", "example_full", recompute, rec_name,
            {**full, "example_save_samples": stats(ttfts("example_save"))["samples"]}),
        res("partial_hit.kvkeeper_vs_recompute", "kvk_partial", recompute, rec_name, partial),
        res("miss.kvkeeper_vs_recompute", "kvk_miss", recompute, rec_name,
            {**common, "kvkeeper_breakdown_s": breakdown(rounds, "kvk_miss")},
            note="engine kvk-a on fresh prompts: a lookup that misses, the prefill, and "
                 "copying the new blocks out of the KV cache to save them (sending them "
                 "happens after, in the background: save_sent_s)"),
    ]
    kc, xc = connector_cost(rounds, "kvk_full"), connector_cost(rounds, "example_full")
    out.append(Result(
        name=pre + "full_hit.connector_cost.kvkeeper_vs_example_connector",
        value=median(kc), unit="s", baseline_name="ExampleConnector lookup + load of the same hit",
        baseline_value=median(xc), better="lower",
        params={**full, "samples": [round(x, 6) for x in kc],
                "baseline_samples": [round(x, 6) for x in xc]},
        note="the part of a full hit's TTFT each connector itself spends: the scheduler's "
             "lookup and the worker's load before the forward pass (ttft_connector.py)"))
    peer = {**full, "hit_sources": {"p2p": hits.full},
            "peer_breakdown_s": breakdown(rounds, "peer_full"),
            "host_breakdown_s": breakdown(rounds, "peer_host")}
    out += [
        res("full_hit.peer_vs_host", "peer_full", ttfts("peer_host"),
            "the same engine's full hit from the daemon's host tier", peer,
            note="engine peer copies a prompt only kvk-a's KV cache holds (the host tier "
                 "dropped it) from kvk-a's shared memory, against its own host-tier hit "
                 "on another prompt of the same length (issue 14)"),
        res("full_hit.peer_vs_recompute", "peer_full", recompute, rec_name, peer),
    ]
    save_sent = [t["dur"] for r in rounds for key in ("kvk_miss", "kvk_save_src")
                 for t in (r[key].get("timings") or []) + (r[key].get("before") or [])
                 if t.get("event") == "save_sent"]
    if save_sent:
        out[8].params["save_sent_s"] = round(median(save_sent), 6)
    return out
