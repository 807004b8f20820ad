"""`kvkeeper bench`: the ledger, control-plane, checksum, data-plane, disk, GC and
eviction-policy benchmarks.

    kvkeeper bench {ledger,control,checksum,data,disk,gc,policy,ttft,stream-hit,gpu,cluster,all}
                   [--json] [--quick] [--out FILE] [--engine-python PATH]
                   [--model CONFIG.json ...] [--trace FILE] [--seed N] [--mix FIELD=VALUE ...]
                   [--redis-cluster]

`cluster` (cluster_bench.py; run only by name: it needs redis-server on PATH)
starts its own redis-server on loopback, --redis-cluster also a Redis Cluster,
and measures the cluster tier's save, load and chain probe against raw redis
client calls of the same bytes and keys.

`policy` replays LLM-serving traces through the ledger with each eviction
policy against the offline optimum (policy_bench.py); --trace FILE replays a
recorded trace instead of the generated mixes (format: policy_trace.py);
--seed N and --mix FIELD=VALUE (a field of policy_trace.Mix, set in every
mix) generate other traces, to check a result against more than one.

Every result carries its baseline, measured again in the same run side by
side (see result.py for the JSON shape). --json prints the results as one
JSON list on stdout; otherwise a table. --out FILE also writes the JSON list
to FILE. --quick shrinks every size and count (a smoke run, ~30 s; its
figures are noisier). Progress goes to stderr.

`all` runs the daemon's own benchmarks (BENCHES), which need nothing beyond
the daemon's dependencies. `ttft` (time to first token of vLLM engines with
KVKeeperConnector, against recompute and vLLM's ExampleConnector) and
`stream-hit` (a full hit over gRPC streams against the same hit over shared
memory) need vLLM and torch and run only when named; they live in
kvkeeper.connector.bench (registry.py says where each benchmark is), and
their engines run on --engine-python (default: $KVKEEPER_BENCH_PYTHON, else
this interpreter). ttft runs a model matrix (two models, three prompt
lengths); --model CONFIG.json (repeatable) runs those Llama-like configs
instead. Nothing here is imported by the daemon, and vLLM and torch
are imported only inside the engine processes those two start. `gpu`
(kvkeeper.connector.gpu.bench: the pinned host<->GPU load and save paths
against raw torch copies) needs torch with CUDA, not vLLM; without CUDA it
says so and exits 1.

Exit status: 0 when the benchmarks ran (whether or not targets were met:
see each result's meets_target), 1 when one could not run, 2 for usage errors.
"""
from __future__ import annotations

import argparse
import sys
import time
from typing import Callable, Optional, Sequence

from .registry import (BENCHES, EXTRA_BENCHES, NAMED_BENCHES, BenchUnavailable,
                       BenchUsageError, runner)
from .policy_trace import TraceError
from .result import Result, render_table, to_json


def run_benches(names: Sequence[str], quick: bool,
                log: Callable[[str], None] = lambda s: None,
                engine_python: Optional[str] = None,
                models: Optional[Sequence[str]] = None,
                trace: Optional[str] = None, seed: Optional[int] = None,
                mix_changes: Optional[dict[str, str]] = None,
                redis_cluster: Optional[bool] = None) -> list[Result]:
    results: list[Result] = []
    for name in names:
        t0 = time.perf_counter()
        if name == "policy" and (trace or seed is not None or mix_changes):
            results += runner(name)(quick=quick, log=log, trace=trace, seed=seed or 1,
                                    mix_changes=mix_changes or {})
        elif name == "ttft":
            results += runner(name)(quick=quick, log=log, python=engine_python, models=models)
        elif name == "cluster":
            results += runner(name)(quick=quick, log=log, redis_cluster=redis_cluster)
        elif name in EXTRA_BENCHES:
            results += runner(name)(quick=quick, log=log, python=engine_python)
        else:
            results += runner(name)(quick=quick, log=log)
        log(f"{name}: done in {time.perf_counter() - t0:.1f}s")
    return results


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvkeeper bench",
        description="Benchmarks of kvkeeper, each against a baseline measured in the same run.",
        epilog="all = " + ", ".join(BENCHES) + " (the daemon's benchmarks). ttft is not in all: "
               "it needs vLLM and torch and starts vLLM engines (CPU build: ~4 min, "
               "--quick ~1 min); run it by name.")
    p.add_argument("which", choices=(*BENCHES, *EXTRA_BENCHES, *NAMED_BENCHES, "all"),
                   help="which benchmark to run; all = " + ", ".join(BENCHES)
                        + "; ttft (vLLM connector time to first token) is not in all")
    p.add_argument("--json", action="store_true", help="print the results as a JSON list")
    p.add_argument("--quick", action="store_true",
                   help="small sizes and counts: a smoke run, not a measurement")
    p.add_argument("--out", metavar="FILE", help="also write the JSON list to FILE")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    p.add_argument("--engine-python", metavar="PATH",
                   help="ttft: the Python (with vLLM and torch) that runs the engines "
                        "(default: $KVKEEPER_BENCH_PYTHON, else this interpreter)")
    p.add_argument("--model", metavar="CONFIG.json", action="append", default=None,
                   help="ttft: run this Llama-like config.json (dummy weights) instead of "
                        "the matrix's M1 and M2; repeatable")
    p.add_argument("--trace", metavar="FILE",
                   help="policy: replay this recorded trace (JSON lines of key chains) "
                        "instead of the generated traffic mixes")
    p.add_argument("--redis-cluster", action="store_true", default=None,
                   help="cluster: also measure against a Redis Cluster of 3 masters and 3 "
                        "replicas it starts on loopback (default: one redis-server only)")
    p.add_argument("--seed", type=int, default=None,
                   help="policy: the generator's seed (default 1)")
    p.add_argument("--mix", metavar="FIELD=VALUE", action="append", default=None,
                   help="policy: set a field of every generated mix (e.g. turn_gap=80, "
                        "scan_blocks=32:128); repeatable")
    return p


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        args = build_parser().parse_args(argv)
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    names = BENCHES if args.which == "all" else (args.which,)
    if args.model and args.which != "ttft":
        print("kvkeeper bench: --model is for ttft only", file=sys.stderr)
        return 2
    if args.trace and args.which != "policy":
        print("kvkeeper bench: --trace is for policy only", file=sys.stderr)
        return 2
    if args.redis_cluster and args.which != "cluster":
        print("kvkeeper bench: --redis-cluster is for cluster only", file=sys.stderr)
        return 2
    if (args.seed is not None or args.mix) and args.which != "policy":
        print("kvkeeper bench: --seed and --mix are for policy only", file=sys.stderr)
        return 2
    mix_changes = dict(m.partition("=")[::2] for m in args.mix or ())
    if any(not k or not v for k, v in mix_changes.items()):
        print("kvkeeper bench: --mix takes FIELD=VALUE", file=sys.stderr)
        return 2

    def log(msg: str) -> None:
        if not args.quiet:
            print(f"[bench] {msg}", file=sys.stderr, flush=True)

    try:
        results = run_benches(names, args.quick, log, engine_python=args.engine_python,
                              models=args.model, trace=args.trace, seed=args.seed,
                              mix_changes=mix_changes, redis_cluster=args.redis_cluster)
    except KeyboardInterrupt:
        print("kvkeeper bench: interrupted", file=sys.stderr)
        return 1
    except BenchUnavailable as e:
        print(f"kvkeeper bench: {args.which} cannot run here: {e}", file=sys.stderr)
        return 1
    except (BenchUsageError, TraceError) as e:   # bad input named on the command line
        print(f"kvkeeper bench: {e}", file=sys.stderr)
        return 2
    except Exception as e:  # noqa: BLE001 - report, do not dump a trace on the user
        import traceback
        traceback.print_exc()
        print(f"kvkeeper bench: {args.which} failed: {e}", file=sys.stderr)
        return 1
    text = to_json(results)
    if args.out:
        with open(args.out, "w") as fh:
            fh.write(text + "\n")
    print(text if args.json else render_table(results))
    return 0


__all__ = ["BENCHES", "EXTRA_BENCHES", "BenchUnavailable", "Result", "build_parser", "main", "run_benches"]
