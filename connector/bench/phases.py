"""Where a request's time went: the engines' timing lines, summed per phase.

The lines come from the timed connectors (ttft_connector.py) through
engine.py's results ("timings": written during the request). cpu_seconds()
tells how much other work shared the machine while a benchmark ran.
"""
from __future__ import annotations

import os
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvkeeper.server.bench.result import median


def cpu_seconds(groups: Sequence[int], pids: Sequence[int]) -> Optional[Tuple[float, float]]:
    """(busy CPU seconds of the whole machine, CPU seconds of the processes in
    process groups `groups` or with ids `pids`), from /proc; None elsewhere."""
    try:
        hz = os.sysconf("SC_CLK_TCK")
        with open("/proc/stat") as fh:
            f = [int(x) for x in fh.readline().split()[1:]]
        busy = sum(f) - f[3] - (f[4] if len(f) > 4 else 0)   # less idle and iowait
        ours = 0
        for name in os.listdir("/proc"):
            if not name.isdigit():
                continue
            try:
                with open(f"/proc/{name}/stat") as fh:
                    st = fh.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(st[2]) in groups or int(name) in pids:   # st[2]: pgrp
                ours += int(st[11]) + int(st[12])            # utime, stime
        return busy / hz, ours / hz
    except (OSError, ValueError, IndexError):
        return None


def connector_cost(rounds: List[Dict[str, Any]], key: str) -> List[float]:
    """Per round: the connector's lookup + load seconds of rounds[i][key]."""
    out = []
    for r in rounds:
        out.append(sum(t["dur"] for t in r[key].get("timings") or ()
                       if t.get("event") in ("lookup", "load")))
    return out


def breakdown(rounds: List[Dict[str, Any]], key: str) -> Dict[str, float]:
    """Median seconds per phase of one request, from the engine's timing lines
    (and vLLM's per-request timestamps: stage.submit, .queue, .step, .out;
    lookup_calls: the scheduler's lookups of the request, more than one
    when an answer was pending and the request waited a step; handoff.*:
    handoffs())."""
    cols: Dict[str, List[float]] = {}
    for r in rounds:
        res = r[key]
        ph: Dict[str, float] = {"ttft": res["ttft"]}
        for t in res.get("timings") or ():
            ev = t.get("event")
            if ev == "lookup":
                ph["lookup"] = ph.get("lookup", 0.0) + t["dur"]
            elif ev == "load":
                ph["load"] = ph.get("load", 0.0) + t["dur"]
                for k, v in t.items():   # the connector's own phases (ttft_connector.py)
                    if k not in ("event", "dur", "blocks", "tokens", "pid", "at", "start_at") and \
                            isinstance(v, (int, float)):
                        ph[f"load.{k}"] = ph.get(f"load.{k}", 0.0) + v
            elif ev == "step":
                ph["forward"] = ph.get("forward", 0.0) + t["forward"]
                ph["save"] = ph.get("save", 0.0) + t["save"]
        known = sum(v for k, v in ph.items() if k in ("lookup", "load", "forward", "save"))
        ph["other"] = ph["ttft"] - known
        # vLLM's own timestamps of the request (engine.stages): the same cut
        # for every engine, connector or not.
        for k, v in (res.get("stages") or {}).items():
            ph[f"stage.{k}"] = v
        ph.update(handoffs(res.get("timings") or ()))
        lookups = [t for t in res.get("timings") or () if t.get("event") == "lookup"]
        if lookups:
            ph["lookup_calls"] = float(len(lookups))
        for k, v in ph.items():
            cols.setdefault(k, []).append(v)
    return {k: round(median(v), 6) for k, v in cols.items()}


def handoffs(timings: Sequence[Dict[str, Any]]) -> Dict[str, float]:
    """Where a loading step's time goes between the processes, from the
    timing lines' "at" (one clock): to_worker, the scheduler's metadata
    built (meta) until the worker bound it (bind: vLLM's hand-off and the
    worker's input preparation); worker, bind until the worker's last
    connector hook of the step (worker_out: loads, forward, the connector's
    output); to_scheduler, worker_out until the scheduler took the
    workers' report (output). Only the first loading step of the request,
    and only what its lines show."""
    first: Dict[str, float] = {}
    for t in timings:
        ev = t.get("event")
        if ev in ("meta", "bind", "worker_out", "output") and ev not in first \
                and isinstance(t.get("at"), (int, float)):
            first[ev] = t["at"]
    out: Dict[str, float] = {}
    for name, a, b in (("to_worker", "meta", "bind"), ("worker", "bind", "worker_out"),
                       ("to_scheduler", "worker_out", "output")):
        if a in first and b in first and first[b] >= first[a]:
            out[f"handoff.{name}"] = first[b] - first[a]
    return out
