"""Per-run figures from per-request records: latency percentiles, throughput, failures."""
from __future__ import annotations

from typing import Any, Dict, List, Optional, Sequence

from .openai_client import RequestRecord

MAX_LISTED_FAILURES = 5


def percentile(values: Sequence[float], q: float) -> Optional[float]:
    """The q-th percentile (0..100), linear between closest ranks (numpy's default)."""
    xs = sorted(values)
    if not xs:
        return None
    pos = (len(xs) - 1) * q / 100.0
    lo = int(pos)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (pos - lo)


def distribution(values: Sequence[float]) -> Optional[Dict[str, float]]:
    if not values:
        return None
    return {"p50": percentile(values, 50), "p90": percentile(values, 90),
            "mean": sum(values) / len(values), "min": min(values), "max": max(values),
            "n": len(values)}


def summarize(records: List[RequestRecord], wall_s: float) -> Dict[str, Any]:
    """{"requests", "ok", "failed", "failures", "duration_s", "throughput", "metrics"}.

    Latencies are over the requests that succeeded; throughput counts their
    output tokens over the run's wall time (first send to last end)."""
    ok = [r for r in records if r.ok]
    failed = [r for r in records if not r.ok]
    out_tokens = sum(r.output_tokens for r in ok)
    wall = max(wall_s, 1e-9)
    return {
        "requests": len(records), "ok": len(ok), "failed": len(failed),
        "failures": [{"id": r.id, "error": r.error} for r in failed[:MAX_LISTED_FAILURES]],
        "duration_s": wall_s, "output_tokens": out_tokens,
        "throughput": {"requests_per_s": len(ok) / wall, "output_tokens_per_s": out_tokens / wall},
        "metrics": {
            "ttft_s": distribution([r.ttft_s for r in ok if r.ttft_s is not None]),
            "tpot_s": distribution([r.tpot_s for r in ok if r.tpot_s is not None]),
            "e2e_s": distribution([r.e2e_s for r in ok if r.e2e_s is not None]),
        },
    }
