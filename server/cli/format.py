"""How the commands print: error lines, sizes, durations, tier names, tables, JSON."""
from __future__ import annotations

import json
import sys
from typing import Any

from kvkeeper.v1 import kvkeeper_pb2 as pb


def err(msg: str) -> None:
    print(f"kvkeeper: {msg}", file=sys.stderr)


def print_json(value: Any) -> None:
    print(json.dumps(value, indent=2))


def fmt_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def fmt_uptime(s: float) -> str:
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h:02d}h {m:02d}m {s:02d}s"
    if h:
        return f"{h}h {m:02d}m {s:02d}s"
    return f"{m}m {s:02d}s" if m else f"{s}s"


def fmt_pct(rate: float | None) -> str:
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def tier_name(tier: int) -> str:
    """"host", "disk": the proto's Tier name without TIER_; a number the proto lacks as is."""
    try:
        name = pb.Tier.Name(tier)
    except ValueError:
        return str(tier)
    return name[len("TIER_"):].lower() if name.startswith("TIER_") else name.lower()


def table(rows: list[tuple[str, ...]], right: frozenset[int] = frozenset()) -> str:
    """Columns padded to their widest cell; columns in `right` aligned right."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return "\n".join("  ".join(c.rjust(w) if i in right else c.ljust(w)
                               for i, (c, w) in enumerate(zip(r, widths))).rstrip()
                     for r in rows) + "\n"
