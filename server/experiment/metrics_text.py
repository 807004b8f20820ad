"""Raw Prometheus `/metrics` text: fetch it, keep it, read counters from it.

Hits are read from the servers' own counters, never inferred from latency: a
counter that a snapshot lacks (server down, metric not exported, text not
parseable) is UNAVAILABLE, and so is any delta that needs it.
"""
from __future__ import annotations

import math
import re
import urllib.error
import urllib.request
from dataclasses import dataclass, field
from typing import Dict, Optional, Sequence, Union

UNAVAILABLE = "unavailable"

# vLLM's own prefix cache (tokens) and the kvkeeper connector's counters on
# vLLM's /metrics (connector/stats.py COUNTERS, exported as vllm:kvkeeper_<name>_total).
VLLM_PREFIX_QUERIES = "vllm:prefix_cache_queries_total"
VLLM_PREFIX_HITS = "vllm:prefix_cache_hits_total"
VLLM_EXTERNAL_HITS = "vllm:external_prefix_cache_hits_total"
CONNECTOR_HIT_TOKENS = "vllm:kvkeeper_hit_tokens_total"
CONNECTOR_LOAD_ERRORS = "vllm:kvkeeper_load_errors_total"
CONNECTOR_LOAD_ERROR_BLOCKS = "vllm:kvkeeper_load_error_blocks_total"
CONNECTOR_CHECKSUM_ERRORS = "vllm:kvkeeper_checksum_errors_total"
# The daemon's /metrics (server/metrics.py).
DAEMON_HIT_BLOCKS = "kvkeeper_hit_blocks_total"
DAEMON_HIT_TOKENS = "kvkeeper_hit_tokens_total"
DAEMON_DISK_CHECKSUM_FAILURES = "kvkeeper_disk_checksum_failures_total"

Delta = Union[float, str]   # a number, or UNAVAILABLE


@dataclass
class Snapshot:
    """One scrape: the raw text as served (or why there is none) and its samples."""
    url: Optional[str]
    text: str = ""
    error: Optional[str] = None
    samples: Dict[str, float] = field(default_factory=dict)   # name -> sum over label sets

    @property
    def ok(self) -> bool:
        return self.error is None

    def value(self, name: str) -> Optional[float]:
        return self.samples.get(name) if self.ok else None

    def raw(self) -> str:
        """What to save as the artifact: the text as served, or a comment saying why not."""
        if self.ok:
            return self.text
        return f"# metrics unavailable from {self.url}: {self.error}\n"


def metrics_url(url: str) -> str:
    """A metrics URL from a base URL: "host:port" gets http://, an empty path /metrics."""
    if "://" not in url:
        url = "http://" + url
    scheme, _, rest = url.partition("://")
    host, slash, path = rest.partition("/")
    return f"{scheme}://{host}/{path}" if slash and path else f"{scheme}://{host}/metrics"


def parse(text: str) -> Dict[str, float]:
    """{sample name: value summed over its label sets} of a Prometheus text exposition.

    A tolerant line parser (rather than prometheus_client's, which rejects a
    whole scrape over one odd line): comments and blank lines are skipped, a
    label set may hold spaces and escaped quotes, a trailing timestamp is
    ignored, NaN samples are left out (they cannot be summed)."""
    out: Dict[str, float] = {}
    for line in text.splitlines():
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        name, rest = _split_name(line)
        if not name:
            continue
        fields = rest.split()
        if not fields:
            continue
        try:
            value = float(fields[0])
        except ValueError:
            continue
        if math.isnan(value):
            continue
        out[name] = out.get(name, 0.0) + value
    return out


def _split_name(line: str) -> tuple[str, str]:
    """(metric name, text after the label set) of one sample line."""
    brace = line.find("{")
    space = line.find(" ")
    if brace < 0 or (0 <= space < brace):
        return (line[:space], line[space:]) if space > 0 else ("", "")
    i, quoted = brace + 1, False
    while i < len(line):  # the closing brace outside quotes; \" and \\ are escapes
        c = line[i]
        if c == "\\" and quoted:
            i += 2
            continue
        if c == '"':
            quoted = not quoted
        elif c == "}" and not quoted:
            return line[:brace], line[i + 1:]
        i += 1
    return "", ""


def fetch(url: Optional[str], timeout: float = 10.0) -> Snapshot:
    """Scrape url; a failure is kept in the snapshot, never raised."""
    if not url:
        return Snapshot(url=None, error="no metrics URL given")
    try:
        with urllib.request.urlopen(url, timeout=timeout) as resp:
            text = resp.read().decode("utf-8", errors="replace")
    except (urllib.error.URLError, OSError, ValueError) as e:
        return Snapshot(url=url, error=f"{type(e).__name__}: {e}")
    return Snapshot(url=url, text=text, samples=parse(text))


def delta(before: Snapshot, after: Snapshot, name: str) -> Delta:
    """after - before of a counter, or UNAVAILABLE when a snapshot lacks it or it
    went down (the server restarted in between: the difference means nothing)."""
    a, b = before.value(name), after.value(name)
    if a is None or b is None or b < a:
        return UNAVAILABLE
    d = b - a
    return int(d) if d.is_integer() else d


def why_unavailable(before: Snapshot, after: Snapshot, name: str) -> str:
    for label, snap in (("before", before), ("after", after)):
        if not snap.ok:
            return f"{label}: {snap.error}"
        if name not in snap.samples:
            return f"{label}: {snap.url} does not export {name}"
    return f"{name} went down between the snapshots (counter reset: server restarted?)"


def deltas(before: Snapshot, after: Snapshot, names: Sequence[str]
           ) -> tuple[Dict[str, Delta], Dict[str, str]]:
    """({name: delta}, {name: why unavailable}) for names."""
    values: Dict[str, Delta] = {}
    reasons: Dict[str, str] = {}
    for name in names:
        values[name] = delta(before, after, name)
        if values[name] == UNAVAILABLE:
            reasons[name] = why_unavailable(before, after, name)
    return values, reasons


def label_value(text: str, name: str, label: str) -> Optional[str]:
    """The value of `label` on the first sample of `name` (e.g. block_size on
    vllm:cache_config_info), or None."""
    pattern = re.compile(r'[{,]\s*' + re.escape(label) + r'="((?:[^"\\]|\\.)*)"')
    for line in text.splitlines():
        if line.startswith(name + "{"):
            m = pattern.search(line)
            if m:
                return m.group(1)
    return None
