"""`kvkeeper experiment prefix`: seed 000 Step 5, the paired prefix experiment.

Unique prefix (baseline) against one long shared prefix (candidate), on one
prefix-caching OpenAI-compatible server (vLLM), with the same requests count,
output length and task text (workload.py). `--mode dry-run` (the default)
writes the plan and the workloads and sends nothing; `--mode real-backend`
runs them:

    for each run (pass 1: baseline, candidate; --swap adds pass 2: candidate, baseline):
        --restart-cmd (before every run but the first), wait for /health or /v1/models
        --warmup requests (their own documents: they warm the server, not the cache)
        snapshot the raw /metrics of vLLM and of the daemon (--daemon-metrics-url)
        the workload, --concurrency requests in flight, streamed; progress on stderr
        snapshot again
    result.json: seed fields, per-run TTFT/TPOT/E2E percentiles, throughput,
    failures, hit-counter deltas (from the snapshots; "unavailable" when missing)

Everything lands under --out DIR: result.json, workloads/*.jsonl, metrics/*.prom.
Exit status: 0 the plan was written or the runs ran (failed requests are
counted in the result), 1 the backend could not be used (unreachable, restart
failed, interrupted), 2 usage error.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence, Tuple

from . import metrics_text as mt
from .artifacts import environment, save_snapshot, write_json
from .lifecycle import RestartError, restart
from .openai_client import Backend, BackendError
from .progress import Progress
from .report import render
from .summary import summarize
from .workload import (DEFAULT_PREFIX_WORDS, WORKLOAD_ID, WORKLOAD_VERSION, pair, read_jsonl,
                       warmup_rows, write_jsonl)

SCHEMA_VERSION = "kvkeeper-experiment-prefix/v1"
ARMS = {"baseline": "unique", "candidate": "shared"}
VLLM_COUNTERS = (mt.VLLM_PREFIX_QUERIES, mt.VLLM_PREFIX_HITS, mt.VLLM_EXTERNAL_HITS,
                 mt.CONNECTOR_HIT_TOKENS, mt.CONNECTOR_LOAD_ERRORS, mt.CONNECTOR_CHECKSUM_ERRORS)
DAEMON_COUNTERS = (mt.DAEMON_HIT_BLOCKS, mt.DAEMON_HIT_TOKENS)


def _positive(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"expected a positive integer, got {v}")
    return v


def _non_negative(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        v = -1
    if v < 0:
        raise argparse.ArgumentTypeError(f"expected an integer >= 0, got {text!r}")
    return v


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="kvkeeper experiment prefix",
        description="Unique vs shared long prefix on a prefix-caching OpenAI-compatible server: "
                    "TTFT, TPOT, throughput, failures, raw /metrics before/between/after.",
        formatter_class=argparse.RawDescriptionHelpFormatter, epilog=__doc__)
    p.add_argument("--mode", choices=("dry-run", "real-backend"), default="dry-run",
                   help="dry-run (default): write the plan and workloads, send nothing")
    p.add_argument("--backend-url", metavar="URL", default="http://127.0.0.1:8000",
                   help="the OpenAI-compatible server (default http://127.0.0.1:8000)")
    p.add_argument("--model", metavar="NAME", help="model name to request (default: the server's first model)")
    p.add_argument("--num-prompts", metavar="N", type=_positive, default=12, help="requests per run (12)")
    p.add_argument("--concurrency", metavar="N", type=_positive, default=4, help="requests in flight (4)")
    p.add_argument("--max-tokens", metavar="N", type=_positive, default=32, help="output tokens (32)")
    p.add_argument("--warmup", metavar="N", type=_non_negative, default=1,
                   help="unmeasured requests before each run, sharing nothing with it (1)")
    p.add_argument("--prefix-words", metavar="N", type=_positive, default=DEFAULT_PREFIX_WORDS,
                   help=f"words of each context document ({DEFAULT_PREFIX_WORDS})")
    p.add_argument("--label", default="default",
                   help="run label: part of the default --out and of every prompt (a new label "
                        "gives new prompts, which neither vLLM nor the daemon holds yet)")
    p.add_argument("--out", metavar="DIR",
                   help="output folder (default ./kvkeeper-experiment-prefix-LABEL)")
    p.add_argument("--swap", action="store_true",
                   help="then rerun in swapped order (candidate first), with fresh prompts")
    p.add_argument("--restart-cmd", metavar="CMD",
                   help="shell command restarting the server; run before every run but the first")
    p.add_argument("--restart-timeout", type=float, default=600.0, metavar="S",
                   help="seconds --restart-cmd may take (600)")
    p.add_argument("--ready-timeout", type=float, default=600.0, metavar="S",
                   help="seconds to wait for /health or /v1/models after a restart (600)")
    p.add_argument("--metrics-url", metavar="URL", help="vLLM's metrics (default: BACKEND_URL/metrics)")
    p.add_argument("--daemon-metrics-url", metavar="URL",
                   help="the kvkeeper daemon's metrics, e.g. http://127.0.0.1:9464/metrics "
                        "(without it the daemon's counters are unavailable)")
    p.add_argument("--api-key", metavar="KEY", default=os.environ.get("OPENAI_API_KEY"),
                   help="bearer token for the server (default $OPENAI_API_KEY)")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="seconds one request may take (600)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let requests stop at EOS (default: ignore_eos, a fixed output length)")
    p.add_argument("--settle-seconds", type=float, default=0.5, metavar="S",
                   help="pause before each post-run scrape, for the last steps' counters (0.5)")
    p.add_argument("-q", "--quiet", action="store_true", help="no progress on stderr")
    return p


# --------------------------------------------------------------------------- plan
def plan(args: argparse.Namespace, out: Path) -> Tuple[List[Dict[str, Any]], Dict[str, Any]]:
    """(runs, workload section): writes the workload files of every pass."""
    runs: List[Dict[str, Any]] = []
    files: Dict[str, Any] = {}
    passes = (1, 2) if args.swap else (1,)
    for pas in passes:
        rows = pair(args.num_prompts, args.max_tokens, f"{args.label}-p{pas}", args.prefix_words)
        for prefix, prefix_rows in rows.items():
            path = out / "workloads" / f"pass{pas}_{prefix}_prefix.jsonl"
            files[f"pass{pas}_{prefix}"] = {
                "path": os.path.relpath(path, out), "sha256": write_jsonl(path, prefix_rows),
                "requests": len(prefix_rows),
                "prompt_chars": sorted({len(r.prompt) for r in prefix_rows}),
                "distinct_prefixes": len({r.prefix_id for r in prefix_rows})}
        order = ("baseline", "candidate") if pas == 1 else ("candidate", "baseline")
        for arm in order:
            runs.append({"index": len(runs) + 1, "pass": pas, "arm": arm, "prefix": ARMS[arm],
                         "workload": files[f"pass{pas}_{ARMS[arm]}"]["path"],
                         "restart_before": bool(args.restart_cmd) and bool(runs),
                         "warmup": args.warmup})
    workload = {"id": WORKLOAD_ID, "version": WORKLOAD_VERSION, "model_id": args.model,
                "num_prompts": args.num_prompts, "concurrency": args.concurrency,
                "max_tokens": args.max_tokens, "warmup": args.warmup, "repeats": 1,
                "prefix_words": args.prefix_words, "ignore_eos": args.ignore_eos,
                "temperature": 0.0, "swap": args.swap, "restart_cmd": args.restart_cmd,
                "files": files}
    return runs, workload


def new_result(args: argparse.Namespace, runs: List[Dict[str, Any]],
               workload: Dict[str, Any]) -> Dict[str, Any]:
    return {
        "schema_version": SCHEMA_VERSION, "experiment": "prefix",
        "run_mode": args.mode.replace("-", "_"), "run_label": args.label,
        "environment": environment(daemon_metrics_url=args.daemon_metrics_url),
        "workload": workload, "plan": runs,
        "baseline": None, "candidate": None, "swapped": None, "runs": [],
        "comparison": None, "metrics_artifacts": {}, "failure": None,
        "evidence_level": "dry_run", "decision": "not_measured",
    }


# --------------------------------------------------------------------------- real backend
class Runner:
    def __init__(self, args: argparse.Namespace, out: Path):
        """ValueError on a malformed --backend-url (before anything is written)."""
        self.args, self.out = args, out
        self.result: Dict[str, Any] = {}
        self.backend = Backend(args.backend_url, args.api_key, args.request_timeout)
        self.vllm_metrics = mt.metrics_url(args.metrics_url or self.backend.base_url)
        self.daemon_metrics = mt.metrics_url(args.daemon_metrics_url) \
            if args.daemon_metrics_url else None
        self.snapshots: List[Dict[str, Any]] = []
        self.extra: Dict[str, Any] = {"temperature": 0.0}
        if args.ignore_eos:
            self.extra["ignore_eos"] = True

    def snapshot(self, name: str) -> Dict[str, mt.Snapshot]:
        snaps = {"vllm": mt.fetch(self.vllm_metrics), "daemon": mt.fetch(self.daemon_metrics)}
        entry: Dict[str, Any] = {"name": name}
        for who, snap in snaps.items():
            entry[who] = save_snapshot(snap, self.out / "metrics" / f"{name}_{who}.prom", self.out)
        self.snapshots.append(entry)
        return snaps

    def go(self, result: Dict[str, Any]) -> None:
        """Run the plan, appending to result["runs"]; raises BackendError, RestartError."""
        self.result = result
        args, b = self.args, self.backend
        model, served = b.connect(args.model)
        self.result["environment"] = environment(b, self.daemon_metrics, served)
        self.result["workload"]["model_id"] = model
        for run in self.result["plan"]:
            self.result["runs"].append(self.one_run(run, model))

    def one_run(self, run: Dict[str, Any], model: str) -> Dict[str, Any]:
        args, b = self.args, self.backend
        name = f"run{run['index']}_{run['arm']}"
        entry: Dict[str, Any] = dict(run)
        if run["restart_before"]:
            entry["restart"] = restart(b, args.restart_cmd, args.restart_timeout,
                                       args.ready_timeout)
        if run["warmup"]:
            warm, _ = b.run(warmup_rows(run["warmup"], args.max_tokens,
                                        f"{args.label}-r{run['index']}", args.prefix_words),
                            model, args.concurrency, self.extra)
            entry["warmup_failed"] = sum(not r.ok for r in warm)
        rows = read_jsonl(self.out / run["workload"], args.max_tokens)
        pre = self.snapshot(f"{name}_pre")
        bar = Progress(f"run {run['index']} {run['arm']} ({run['prefix']})", len(rows),
                       enabled=not args.quiet)
        records, wall = b.run(rows, model, args.concurrency, self.extra,
                              on_done=lambda r: bar.step(r.ok))
        time.sleep(args.settle_seconds)
        post = self.snapshot(f"{name}_post")
        entry.update(summarize(records, wall))
        v, why_v = mt.deltas(pre["vllm"], post["vllm"], VLLM_COUNTERS)
        d, why_d = mt.deltas(pre["daemon"], post["daemon"], DAEMON_COUNTERS)
        entry["counters"] = {**v, **d}
        entry["counters_unavailable"] = {**why_v, **why_d}
        entry["metrics_snapshots"] = {"pre": f"{name}_pre", "post": f"{name}_post"}
        entry["requests_detail"] = [r.to_json() for r in records]
        return entry


# --------------------------------------------------------------------------- verdict
def _ratio(cand: Any, base: Any, *path: str) -> Optional[float]:
    for key in path:
        cand = cand.get(key) if isinstance(cand, dict) else None
        base = base.get(key) if isinstance(base, dict) else None
    if isinstance(cand, (int, float)) and isinstance(base, (int, float)) and base:
        return cand / base
    return None


def compare(base: Dict[str, Any], cand: Dict[str, Any]) -> Dict[str, Optional[float]]:
    """candidate / baseline of the headline figures (below 1: the shared prefix is faster)."""
    return {"ttft_p50_ratio": _ratio(cand, base, "metrics", "ttft_s", "p50"),
            "ttft_p90_ratio": _ratio(cand, base, "metrics", "ttft_s", "p90"),
            "tpot_p50_ratio": _ratio(cand, base, "metrics", "tpot_s", "p50"),
            "throughput_ratio": _ratio(cand, base, "throughput", "output_tokens_per_s")}


def conclude(result: Dict[str, Any]) -> None:
    """Fill baseline/candidate/swapped, comparison, metrics_artifacts, evidence and decision."""
    def brief(run: Dict[str, Any]) -> Dict[str, Any]:
        return {k: v for k, v in run.items() if k != "requests_detail"}

    runs = result["runs"]
    by = {(r["pass"], r["arm"]): r for r in runs}
    if (1, "baseline") in by:
        result["baseline"] = brief(by[(1, "baseline")])
    if (1, "candidate") in by:
        result["candidate"] = brief(by[(1, "candidate")])
    if (2, "baseline") in by and (2, "candidate") in by:
        result["swapped"] = {"baseline": brief(by[(2, "baseline")]),
                             "candidate": brief(by[(2, "candidate")])}
    comp = {}
    for pas in (1, 2):
        if (pas, "baseline") in by and (pas, "candidate") in by:
            comp[f"pass{pas}"] = compare(by[(pas, "baseline")], by[(pas, "candidate")])
    result["comparison"] = comp or None
    if result["failure"] is not None:
        result["evidence_level"] = "failed_real_backend_attempt"
        result["decision"] = "reject_until_environment_fixed"
        return
    hits_known = all(r["counters"].get(mt.VLLM_PREFIX_HITS) != mt.UNAVAILABLE for r in runs)
    result["evidence_level"] = "backend_mechanism_benchmark" if hits_known \
        else "backend_latency_only"
    failed = sum(r["failed"] for r in runs)
    result["decision"] = "reject_until_failures_fixed" if failed else "tune"


def run(argv: Optional[Sequence[str]] = None) -> Tuple[int, Optional[Path]]:
    """The command, for scripts and tests: (exit status, path of result.json or None)."""
    try:
        args = build_parser().parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return (e.code if isinstance(e.code, int) else 0 if e.code is None else 2), None
    out = Path(args.out or f"kvkeeper-experiment-prefix-{args.label}").resolve()
    try:
        runner = Runner(args, out) if args.mode == "real-backend" else None
        runs, workload = plan(args, out)
    except (OSError, ValueError) as e:
        print(f"kvkeeper experiment prefix: {e}", file=sys.stderr)
        return 2, None
    result = new_result(args, runs, workload)
    result_path = out / "result.json"
    rc = 0
    if runner is not None:
        t0 = time.monotonic()
        try:
            runner.go(result)
        except (BackendError, RestartError, OSError) as e:
            result["failure"] = {"type": type(e).__name__, "message": str(e)}
        except KeyboardInterrupt:
            result["failure"] = {"type": "KeyboardInterrupt", "message": "interrupted"}
        result["environment"]["duration_s"] = time.monotonic() - t0
        snaps = runner.snapshots
        result["metrics_artifacts"] = {
            "before": snaps[0] if snaps else None,
            "between": snaps[1:-1], "after": snaps[-1] if len(snaps) > 1 else None}
        conclude(result)
        if result["failure"] is not None:
            print(f"kvkeeper experiment prefix: {result['failure']['message']}", file=sys.stderr)
            rc = 1
    write_json(result_path, result)
    sys.stdout.write(render(result))
    print(f"result: {result_path}")
    return rc, result_path


def main(argv: Optional[Sequence[str]] = None) -> int:
    return run(argv)[0]
