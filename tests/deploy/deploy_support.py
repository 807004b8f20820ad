"""Helpers for tests/deploy: paths, a `kvkeeper serve` subprocess, unit-file and
PromQL parsing. (A plain module, not a conftest: the name is unique in tests/.)"""
from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import time
import uuid
from pathlib import Path
from typing import Any, Iterable, Optional
from kvkeeper.server.bench.ports import free_port

ROOT = Path(__file__).resolve().parents[2]
DEPLOY = ROOT / "deploy"
KVKEEPER = [sys.executable, "-m", "kvkeeper.server.cli"]


def clean_env(**extra: str) -> dict[str, str]:
    """os.environ without KVKEEPER_* and NOTIFY_SOCKET, plus `extra`."""
    env = {k: v for k, v in os.environ.items()
           if not k.startswith("KVKEEPER_") and k != "NOTIFY_SOCKET"}
    env.update(extra)
    return env


def serve_args(sock: Path, *, metrics: str = "", tcp: str = "") -> list[str]:
    """`kvkeeper serve` on a temp socket with a 1 MiB arena of 4 KiB pages."""
    return KVKEEPER + ["serve", "--socket", str(sock), "--tcp", tcp, "--metrics", metrics,
                       "--capacity", "1MiB", "--page-size", "4KiB",
                       "--set", f"host_tier.name=kvkeeper-deploytest-{uuid.uuid4().hex[:12]}",
                       "--set", "server.grace_seconds=1"]


def socket_accepts(path: Path) -> bool:
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.connect(str(path))
        return True
    except OSError:
        return False
    finally:
        s.close()


def wait_until(pred: Any, timeout: float, what: str, proc: Optional[subprocess.Popen] = None,
               interval: float = 0.05) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = pred()
        if value:
            return value
        if proc is not None and proc.poll() is not None:
            err = proc.stderr.read() if proc.stderr else ""
            raise AssertionError(f"process exited ({proc.returncode}) while waiting for {what}: {err}")
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {what}")
        time.sleep(interval)


def stop(proc: subprocess.Popen, timeout: float = 20.0) -> tuple[int, str]:
    """SIGTERM, wait; (exit status, stderr)."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return proc.returncode, err or ""


# --------------------------------------------------------------------------- unit files
def parse_unit(text: str) -> dict[str, list[tuple[str, str]]]:
    """{section: [(key, value), ...]} keeping repeated keys in order (systemd semantics)."""
    sections: dict[str, list[tuple[str, str]]] = {}
    current = None
    pending = ""
    for raw in text.splitlines():
        line = pending + raw.strip()
        pending = ""
        if line.endswith("\\"):
            pending = line[:-1] + " "
            continue
        if not line or line[0] in "#;":
            continue
        if line.startswith("[") and line.endswith("]"):
            current = line[1:-1]
            sections.setdefault(current, [])
            continue
        key, _, value = line.partition("=")
        assert current is not None, f"assignment outside a section: {raw!r}"
        sections[current].append((key.strip(), value.strip()))
    return sections


def unit_values(unit: dict[str, list[tuple[str, str]]], section: str, key: str) -> list[str]:
    """Values of `key` as systemd sees them: an empty assignment resets the list."""
    out: list[str] = []
    for k, v in unit.get(section, []):
        if k == key:
            out = [] if v == "" else out + [v]
    return out


def seconds(text: str) -> float:
    """A systemd time span ("30", "30s", "1min 30s", "2m") in seconds."""
    units = {"us": 1e-6, "ms": 1e-3, "s": 1, "sec": 1, "m": 60, "min": 60, "h": 3600, "hr": 3600}
    total = 0.0
    for num, unit in re.findall(r"(\d+(?:\.\d+)?)\s*([a-z]*)", text):
        total += float(num) * units[unit or "s"]
    return total


# --------------------------------------------------------------------------- PromQL
_FUNC_OR_KEYWORD = {
    "by", "without", "on", "ignoring", "group_left", "group_right", "offset", "bool",
    "and", "or", "unless", "atan2", "inf", "nan",
}
_STRING = re.compile(r'"(?:\\.|[^"\\])*"|\'(?:\\.|[^\'\\])*\'|`[^`]*`')
_BRACES = re.compile(r"\{[^{}]*\}")
_BRACKETS = re.compile(r"\[[^\[\]]*\]")
_GROUPING = re.compile(r"\b(by|without|on|ignoring|group_left|group_right)\s*\([^()]*\)")
_IDENT = re.compile(r"(?<![\w:.$])([A-Za-z_:][\w:]*)(\s*\()?")


def metric_names(expr: str) -> set[str]:
    """Metric names an expression selects (Grafana variables such as $job allowed).

    Strings, label matchers {...}, ranges [...] and by/on/... label lists are
    removed first; what is left of the identifiers, less functions (followed by
    "(") and keywords, are metric names."""
    e = _STRING.sub('""', expr)
    e = _BRACES.sub("", e)
    e = _BRACKETS.sub("", e)
    e = _GROUPING.sub(" ", e)
    names = set()
    for m in _IDENT.finditer(e):
        ident, call = m.group(1), m.group(2)
        if call or ident.lower() in _FUNC_OR_KEYWORD:
            continue
        names.add(ident)
    return names


def dashboard_exprs(dashboard: dict) -> list[tuple[str, str]]:
    """(where, PromQL) for every panel target and every query variable."""
    out: list[tuple[str, str]] = []

    def panels(items: Iterable[dict]) -> Iterable[dict]:
        for p in items:
            yield p
            yield from panels(p.get("panels", []))

    for p in panels(dashboard.get("panels", [])):
        for t in p.get("targets", []):
            if "expr" in t:
                out.append((f"panel {p.get('title')!r} target {t.get('refId')}", t["expr"]))
    for v in dashboard.get("templating", {}).get("list", []):
        if v.get("type") == "query":
            q = v.get("query")
            q = q.get("query") if isinstance(q, dict) else q
            m = re.fullmatch(r"\s*label_values\((.*),\s*\w+\)\s*", q or "")
            out.append((f"variable {v['name']}", m.group(1) if m else q))
    return out


def grafana_to_promql(expr: str, rate_interval: str = "1m") -> str:
    """A dashboard expression with Grafana's variables replaced by plain values."""
    e = expr.replace("$__rate_interval", rate_interval).replace("$__interval", rate_interval)
    e = e.replace("$__range", "5m")
    return re.sub(r"\$\{?(\w+)\}?", ".*", e)
