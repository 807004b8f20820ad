"""The summary table of a prefix experiment's result, and the TTFT plot.

    kvkeeper experiment report RESULT.json [--plot out.png]

The table has one row per run: requests ok/total, TTFT p50/p90, TPOT p50,
end-to-end p50 (milliseconds), throughput, and the hit-counter deltas read
from the /metrics snapshots ("n/a" where the result says unavailable). The
plot (matplotlib; `pip install matplotlib` or `pip install 'kvkeeper[experiment]'`)
draws each run's TTFT distribution as an empirical CDF.
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any, Dict, List, Optional, Sequence

from . import metrics_text as mt

COUNTER_COLUMNS = (("vllm prefix hit tok", mt.VLLM_PREFIX_HITS),
                   ("kvk hit tok (vllm)", mt.CONNECTOR_HIT_TOKENS),
                   ("daemon hit blocks", mt.DAEMON_HIT_BLOCKS))


def _ms(dist: Optional[Dict[str, Any]], key: str) -> str:
    v = dist.get(key) if dist else None
    return "-" if v is None else f"{1000 * v:.1f}"


def _count(v: Any) -> str:
    if v is None or v == mt.UNAVAILABLE:
        return "n/a"
    return f"{v:g}" if isinstance(v, float) else str(v)


def table(rows: List[Sequence[str]]) -> str:
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    lines = []
    for n, r in enumerate(rows):
        lines.append("  ".join(c.ljust(w) if i < 2 else c.rjust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip())
        if n == 0:
            lines.append("  ".join("-" * w for w in widths))
    return "\n".join(lines) + "\n"


def run_rows(runs: List[Dict[str, Any]]) -> List[Sequence[str]]:
    head = ("run", "arm (prefix)", "ok/n", "TTFT p50 ms", "TTFT p90 ms", "TPOT p50 ms",
            "E2E p50 ms", "req/s", "out tok/s", *(c for c, _ in COUNTER_COLUMNS))
    rows: List[Sequence[str]] = [head]
    for r in runs:
        m = r.get("metrics") or {}
        tp = r.get("throughput") or {}
        counters = r.get("counters") or {}
        rows.append((f"{r['index']} (pass {r['pass']})", f"{r['arm']} ({r['prefix']})",
                     f"{r['ok']}/{r['requests']}", _ms(m.get("ttft_s"), "p50"),
                     _ms(m.get("ttft_s"), "p90"), _ms(m.get("tpot_s"), "p50"),
                     _ms(m.get("e2e_s"), "p50"), f"{tp.get('requests_per_s', 0):.2f}",
                     f"{tp.get('output_tokens_per_s', 0):.1f}",
                     *(_count(counters.get(name)) for _, name in COUNTER_COLUMNS)))
    return rows


def render(result: Dict[str, Any]) -> str:
    """The table (or the plan of a dry run), the comparison, the verdict."""
    w = result.get("workload") or {}
    out = [f"experiment prefix [{result.get('run_label')}] {result.get('run_mode')}: "
           f"{w.get('num_prompts')} prompts x {w.get('max_tokens')} tokens, "
           f"concurrency {w.get('concurrency')}, warmup {w.get('warmup')}, "
           f"model {w.get('model_id') or '(server default)'}"]
    if result.get("runs"):
        out.append(table(run_rows(result["runs"])).rstrip("\n"))
    else:
        out.append("plan:")
        for p in result.get("plan") or ():
            out.append(f"  run {p['index']} (pass {p['pass']}): {p['arm']} ({p['prefix']} prefix) "
                       f"{p['workload']}" + ("  after --restart-cmd" if p["restart_before"] else ""))
    for pas, comp in (result.get("comparison") or {}).items():
        figures = ", ".join(f"{k} {v:.3f}" for k, v in comp.items() if v is not None)
        out.append(f"{pas}: candidate/baseline {figures or 'n/a'}")
    unavailable = sorted({k for r in result.get("runs") or () for k, v in
                          (r.get("counters") or {}).items() if v == mt.UNAVAILABLE})
    if unavailable:
        out.append("unavailable (not exported or not scraped): " + ", ".join(unavailable))
    if result.get("failure"):
        out.append(f"failure: {result['failure']['type']}: {result['failure']['message']}")
    out.append(f"evidence: {result.get('evidence_level')}; decision: {result.get('decision')}")
    return "\n".join(out) + "\n"


class PlotUnavailable(RuntimeError):
    """matplotlib is not installed."""


def plot(result: Dict[str, Any], path: Path) -> None:
    """The TTFT distribution of every run as an empirical CDF, saved to path."""
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        raise PlotUnavailable("--plot needs matplotlib: pip install matplotlib "
                              "(or pip install 'kvkeeper[experiment]')") from None
    fig, ax = plt.subplots(figsize=(7, 4.5))
    drawn = 0
    for r in result.get("runs") or ():
        ttft = sorted(1000 * q["ttft_s"] for q in r.get("requests_detail") or ()
                      if q.get("ok") and q.get("ttft_s") is not None)
        if not ttft:
            continue
        ys = [(i + 1) / len(ttft) for i in range(len(ttft))]
        ax.step(ttft, ys, where="post", marker=".",
                label=f"run {r['index']}: {r['arm']} ({r['prefix']} prefix), n={len(ttft)}")
        drawn += 1
    if not drawn:
        plt.close(fig)
        raise ValueError("the result holds no successful request to plot (dry run?)")
    ax.set_xlabel("time to first token (ms)")
    ax.set_ylabel("fraction of requests")
    ax.set_title(f"TTFT, unique vs shared prefix [{result.get('run_label')}]")
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small")
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)


def main(argv: Optional[Sequence[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="kvkeeper experiment report",
                                description="Print the table of a prefix experiment's result.json "
                                            "and optionally plot the TTFT distributions.")
    p.add_argument("result", metavar="RESULT.json")
    p.add_argument("--plot", metavar="OUT.png", help="write the TTFT plot here (needs matplotlib)")
    try:
        args = p.parse_args(list(sys.argv[1:] if argv is None else argv))
    except SystemExit as e:
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    try:
        result = json.loads(Path(args.result).read_text(encoding="utf-8"))
        if not isinstance(result, dict) or "schema_version" not in result:
            raise ValueError("not a kvkeeper experiment result (no schema_version)")
    except (OSError, ValueError) as e:
        print(f"kvkeeper experiment report: {args.result}: {e}", file=sys.stderr)
        return 2
    sys.stdout.write(render(result))
    if args.plot:
        try:
            plot(result, Path(args.plot))
        except (PlotUnavailable, ValueError, OSError) as e:
            print(f"kvkeeper experiment report: {e}", file=sys.stderr)
            return 1
        print(f"plot: {args.plot}")
    return 0
