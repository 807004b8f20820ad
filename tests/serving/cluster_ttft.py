"""Time to first token of a full hit through the cluster tier, against recompute
and against the same hit from the local arena, on the ttft bench's models.

    flock /work/wt/engine.lock python tests/serving/cluster_ttft.py [--models m1,m2]
        [--tokens 2048] [--reps 5] [--json OUT]

Issue 16's TTFT row. A measurement, run by hand under the engine lock, not a
test (no timing asserts in the suite). One redis-server on loopback, two
daemons with separate arenas sharing it ([cluster_tier], write-through), as on
two hosts; per model (connector/bench/model.py's M1 and M2, dummy weights,
blocks of 32 tokens, vLLM's prefix cache off) four engines, each its own
process:

  kvk-a      on daemon 1: computes each fresh prompt and saves it (arena + cluster)
  recompute  no connector: computes the same prompt
  host-hit   on daemon 1: loads it from daemon 1's arena (the same-host hit)
  cluster    on daemon 2, whose arena never held it: loads it through the
             cluster tier (probe, GET, checks, copy into the arena, then the
             same shared-memory load)

One request at a time with the bench's pauses (rig.py), host-hit and cluster
alternating which goes first; every hit must report N-1 hit tokens and give
recompute's greedy token, or the run fails. Medians over --reps repetitions
after one warm-up, and the load average before and after.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Dict, List

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent / "connector"))

from connector_harness import DaemonProcess, short_tmpdir  # noqa: E402

from kvkeeper.connector.bench.model import M1, M2, Prompts, kv_bytes_per_token, write_model  # noqa: E402
from kvkeeper.connector.bench.rig import Rig, engine_args  # noqa: E402
from kvkeeper.connector.bench.verify import SavedProbe  # noqa: E402
from kvkeeper.server.bench.redis_procs import RedisServer, free_port  # noqa: E402

MODELS = {"m1": M1, "m2": M2}


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def load() -> str:
    return " ".join(f"{x:.2f}" for x in os.getloadavg())


def daemon(tmp: str, name: str, redis_url: str) -> DaemonProcess:
    return DaemonProcess(f"{tmp}/{name}.sock", capacity="1GiB", page="64KiB",
                         log_path=f"{tmp}/daemon-{name}.log", metrics=f"127.0.0.1:{free_port()}",
                         extra_args=["--set", f"cluster_tier.url={redis_url}",
                                     "--set", "cluster_tier.write_policy=write-through",
                                     # A 2048-token prompt commits 64 blocks at once and the
                                     # tier sends their SETs together: redis-py refuses
                                     # calls beyond max_connections (dropped writes), so
                                     # leave room for a whole prompt.
                                     "--set", "cluster_tier.max_connections=256"])


def check(name: str, r: Dict[str, Any], want_hit: int, tokens: List[int]) -> None:
    got = r["params"]["kvkeeper"]["hit_tokens"] if r.get("params") else 0
    if got != want_hit or r["tokens"] != tokens:
        raise RuntimeError(f"{name}: hit {got} tokens (want {want_hit}), tokens {r['tokens']} "
                           f"(recompute {tokens})")


def run_model(name: str, n: int, reps: int, d1: DaemonProcess, d2: DaemonProcess,
              tmp: str) -> Dict[str, Any]:
    cfg = MODELS[name]
    mdir = write_model(os.path.join(tmp, f"model-{name}"), cfg)
    rig = Rig(tmp, log, sys.executable, f"cluster-ttft {name}")
    common = engine_args(mdir, True, max(4096, n + 64))

    def kvk(url: str) -> List[str]:
        return [*common, "--connector", "kvkeeper", "--url", url, "--report"]

    rig.start_engines({"kvk-a": kvk(d1.url), "recompute": [*common, "--connector", "none"],
                       "host-hit": kvk(d1.url), "cluster": kvk(d2.url)})
    probe = SavedProbe(d1.url, "cluster-ttft")
    prompts = Prompts(cfg["vocab_size"], seed=16)
    ttft: Dict[str, List[float]] = {"recompute": [], "host-hit": [], "cluster": []}
    try:
        for rep in range(reps + 1):
            full = prompts.tokens(n)
            a = rig.one("kvk-a", full)
            probe.wait_saved([(a, full)])
            r = rig.one("recompute", full)
            order = ("host-hit", "cluster") if rep % 2 else ("cluster", "host-hit")
            got = {k: rig.one(k, full) for k in order}
            for k, res in got.items():
                check(k, res, n - 1, r["tokens"])
            if rep:   # rep 0 warms up
                ttft["recompute"].append(r["ttft"])
                for k, res in got.items():
                    ttft[k].append(res["ttft"])
            log(f"{name} rep {rep}: recompute {r['ttft'] * 1e3:.0f} ms, host-hit "
                f"{got['host-hit']['ttft'] * 1e3:.0f} ms, cluster {got['cluster']['ttft'] * 1e3:.0f} ms")
    finally:
        probe.close()
        rig.close()
    med = {k: statistics.median(v) for k, v in ttft.items()}
    return {"model": name, "prompt_tokens": n, "reps": reps,
            "kv_bytes": n * kv_bytes_per_token(cfg),
            "median_ttft_s": med, "ttft_s": ttft,
            "cluster_vs_recompute": med["cluster"] / med["recompute"],
            "cluster_vs_host_hit": med["cluster"] / med["host-hit"]}


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--models", default="m1,m2")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--reps", type=int, default=5)
    p.add_argument("--json", metavar="OUT")
    args = p.parse_args()
    if args.tokens % 32:
        p.error("--tokens must be a multiple of 32 (whole blocks: a hit of N-1 tokens)")
    tmp = short_tmpdir()
    out: Dict[str, Any] = {"load_before": load(), "runs": []}
    with RedisServer() as redis:
        d1, d2 = daemon(tmp, "one", redis.url), daemon(tmp, "two", redis.url)
        try:
            d1.start()
            d2.start()
            for name in args.models.split(","):
                out["runs"].append(run_model(name, args.tokens, args.reps, d1, d2, tmp))
        finally:
            d1.cleanup()
            d2.cleanup()
    out["load_after"] = load()
    text = json.dumps(out, indent=2)
    print(text)
    if args.json:
        Path(args.json).write_text(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
