"""One benchmark result, its side-by-side baseline, and how both are shown.

Every result compares a kvkeeper figure (`value`) with a baseline measured in
the same run, on the same machine, with the same sizes and counts
(`baseline_value`); nothing is hard-coded. `ratio` is always
value / baseline_value. `better` says which way is good for `value`
("lower" for latencies, costs and bytes; "higher" for rates), and `target`,
when the issue sets one, is a comparison such as "<= 1.5" applied to
`target_of` ("ratio", or "value" where the target is an absolute figure such
as bytes per block). Results without a target are informational:
`target` and `meets_target` are None.

JSON shape of one result (keys always present):

    {"name": "control.match.p50_us.c1", "group": "control",
     "value": 210.3, "unit": "us",
     "baseline_name": "grpc.aio echo p50 (8192 B in)", "baseline_value": 160.1,
     "ratio": 1.31, "better": "lower",
     "target": "<= 1.5", "target_of": "ratio", "meets_target": true,
     "params": {...}, "note": "..."}
"""
from __future__ import annotations

import json
import math
import operator
import statistics
from dataclasses import asdict, dataclass, field
from typing import Any, Callable, Iterable, Optional, Sequence

_OPS: dict[str, Callable[[float, float], bool]] = {
    "<=": operator.le, ">=": operator.ge, "<": operator.lt, ">": operator.gt}


def parse_target(target: str) -> tuple[str, float]:
    """("<=", 1.5) from "<= 1.5"; ValueError for anything else."""
    text = target.strip()
    for op in ("<=", ">=", "<", ">"):
        if text.startswith(op):
            return op, float(text[len(op):])
    raise ValueError(f"target {target!r} is not '<= X', '>= X', '< X' or '> X'")


def _finite(x: float) -> Optional[float]:
    return x if isinstance(x, (int, float)) and math.isfinite(x) else None


@dataclass
class Result:
    name: str
    value: float
    unit: str
    baseline_name: str
    baseline_value: float
    better: str                          # "lower" | "higher"
    target: Optional[str] = None         # e.g. "<= 1.5"; None: informational
    target_of: str = "ratio"             # "ratio" | "value"
    group: str = ""
    params: dict[str, Any] = field(default_factory=dict)
    note: str = ""
    ratio: Optional[float] = field(init=False, default=None)
    meets_target: Optional[bool] = field(init=False, default=None)

    def __post_init__(self) -> None:
        if self.better not in ("lower", "higher"):
            raise ValueError(f"better must be 'lower' or 'higher', got {self.better!r}")
        if self.target_of not in ("ratio", "value"):
            raise ValueError(f"target_of must be 'ratio' or 'value', got {self.target_of!r}")
        if not self.group:
            self.group = self.name.split(".", 1)[0]
        self.value = float(self.value)
        self.baseline_value = float(self.baseline_value)
        self.ratio = (_finite(self.value / self.baseline_value)
                      if self.baseline_value else None)
        if self.target is not None:
            op, bound = parse_target(self.target)
            subject = self.ratio if self.target_of == "ratio" else self.value
            self.meets_target = None if subject is None else bool(_OPS[op](subject, bound))

    def as_dict(self) -> dict[str, Any]:
        d = asdict(self)
        order = ["name", "group", "value", "unit", "baseline_name", "baseline_value", "ratio",
                 "better", "target", "target_of", "meets_target", "params", "note"]
        return {k: d[k] for k in order}


# --------------------------------------------------------------------------- statistics
def percentile(samples: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation between closest ranks."""
    if not samples:
        raise ValueError("no samples")
    xs = sorted(samples)
    if len(xs) == 1:
        return float(xs[0])
    pos = (len(xs) - 1) * q / 100.0
    lo = int(math.floor(pos))
    hi = min(lo + 1, len(xs) - 1)
    return float(xs[lo] + (xs[hi] - xs[lo]) * (pos - lo))


def median(samples: Iterable[float]) -> float:
    return float(statistics.median(list(samples)))


# --------------------------------------------------------------------------- output
def to_json(results: Sequence[Result]) -> str:
    return json.dumps([r.as_dict() for r in results], indent=2)


def _num(x: Optional[float]) -> str:
    if x is None:
        return "-"
    ax = abs(x)
    if ax == 0:
        return "0"
    if ax >= 1e6:
        return f"{x:.3g}"
    if ax >= 100:
        return f"{x:.0f}"
    if ax >= 10:
        return f"{x:.1f}"
    if ax >= 0.01:
        return f"{x:.3f}"
    return f"{x:.3g}"


def render_table(results: Sequence[Result]) -> str:
    """A plain-text table: one line per result, its baseline on the same line."""
    headers = ["result", "value", "unit", "baseline", "ratio", "better", "target", "met"]
    rows = []
    for r in results:
        tgt = "-" if r.target is None else (
            f"ratio {r.target}" if r.target_of == "ratio" else f"value {r.target}")
        met = "-" if r.meets_target is None else ("yes" if r.meets_target else "NO")
        rows.append([r.name, _num(r.value), r.unit, f"{_num(r.baseline_value)} ({r.baseline_name})",
                     _num(r.ratio), r.better, tgt, met])
    widths = [max(len(h), *(len(row[i]) for row in rows)) if rows else len(h)
              for i, h in enumerate(headers)]
    right = {1, 4}

    def fmt(row: list[str]) -> str:
        return "  ".join(c.rjust(w) if i in right else c.ljust(w)
                         for i, (c, w) in enumerate(zip(row, widths))).rstrip()

    lines = [fmt(headers), fmt(["-" * w for w in widths])]
    lines += [fmt(row) for row in rows]
    targeted = [r for r in results if r.meets_target is not None]
    met = sum(1 for r in targeted if r.meets_target)
    lines.append("")
    lines.append(f"{met}/{len(targeted)} targets met; {len(results) - len(targeted)} informational results")
    return "\n".join(lines)
