"""`kvkeeper status`: a running daemon's Stats and health, as a table or JSON."""
from __future__ import annotations

import argparse
import sys
from typing import Any, Optional

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvkeeper.v1 import kvkeeper_pb2, kvkeeper_pb2_grpc

from .channel import Target, add_connection_args, call_daemon
from .format import fmt_bytes, fmt_pct, fmt_uptime, print_json, table, tier_name

_TIER_FIELDS = ("capacity_bytes", "used_bytes", "pinned_bytes", "evictable_bytes",
                "capacity_pages", "used_pages", "blocks", "pending_blocks", "evictions",
                "hit_blocks")
_STAT_FIELDS = ("sessions", "leases", "reservations", "namespaces", "lookups", "lookup_keys",
                "hit_blocks", "hit_tokens", "lookup_blocks", "lookup_tokens", "prompt_blocks",
                "prompt_tokens")
_CLUSTER = "cluster_"   # the cluster tier's series (server/tiers/cluster/tier.py SERIES)
_ENGINE_FIELDS = ("resident_blocks", "resident_bytes", "capacity_blocks")


def add_command(sub: Any) -> None:
    """Register `status` on the `kvkeeper` subparsers."""
    status = sub.add_parser("status", help="show a running daemon's state")
    add_connection_args(status)
    status.set_defaults(func=cmd_status)


def status_dict(stats: Any, health: str, url: str) -> dict[str, Any]:
    """A StatsResponse (plus the health status) as plain JSON-able values."""
    d: dict[str, Any] = {"url": url, "version": stats.version,
                         "uptime_seconds": stats.uptime_seconds, "health": health,
                         "eviction_policy": stats.eviction_policy}
    d.update({k: getattr(stats, k) for k in _STAT_FIELDS})
    # Of the tokens asked beyond the engines' own prefix caches, and of whole
    # prompts: what the engines really loaded (see server/ledger/usage.py).
    d["hit_rate"] = stats.hit_tokens / stats.lookup_tokens if stats.lookup_tokens else None
    d["prompt_hit_rate"] = (stats.hit_tokens / stats.prompt_tokens if stats.prompt_tokens
                            else None)
    d["tiers"] = [{"tier": tier_name(t.tier), **{k: getattr(t, k) for k in _TIER_FIELDS}}
                  for t in stats.tiers]
    d["cluster"] = cluster_summary(stats.tier_series)
    if d["cluster"] is not None:
        _cluster_row(d["tiers"], d["cluster"])
    # The gpu tier: what each reporting engine's own KV cache holds.
    d["engines"] = [{"engine": e.engine, "instance_id": e.instance_id,
                     "namespace_id": e.namespace_id.hex(), **{k: getattr(e, k) for k in _ENGINE_FIELDS}}
                    for e in stats.engines]
    return d


def _cluster_row(tiers: list[dict[str, Any]], cluster: dict[str, Any]) -> None:
    """The daemon's book of the cluster tier holds only the copies in flight
    (its capacity is a placeholder): the row shows the cluster's own memory,
    maxmemory as capacity (0: none set) and used_memory as used; the book's
    bytes stay as in_flight_bytes."""
    for t in tiers:
        if t["tier"] == "cluster":
            t["in_flight_bytes"] = t["used_bytes"]
            t["capacity_bytes"] = cluster.get("maxmemory_bytes", 0)
            t["used_bytes"] = cluster.get("used_memory_bytes", 0)


def cluster_summary(series: Any) -> Optional[dict[str, Any]]:
    """The cluster tier's series (TierSeries named cluster_*, as /metrics has
    them) as {"hit_blocks": ..., "errors": {kind: n}}; None without a cluster tier."""
    out: dict[str, Any] = {}
    errors: dict[str, int] = {}
    for s in series:
        if not s.name.startswith(_CLUSTER):
            continue
        name = s.name[len(_CLUSTER):]
        if name == "errors" and "kind" in s.labels:
            errors[s.labels["kind"]] = int(s.value)
        elif not s.labels:
            out[name] = int(s.value)
    if not out:
        return None
    out["up"] = bool(out.get("up"))
    out["errors"] = errors
    return out


def render_cluster(c: dict[str, Any]) -> list[tuple[str, str]]:
    """Rows of the status table for the cluster tier."""
    used, cap = c.get("used_memory_bytes", 0), c.get("maxmemory_bytes", 0)
    memory = fmt_bytes(used) + (f" of {fmt_bytes(cap)} maxmemory ({100 * used / cap:.0f}%)"
                                if cap else " (no maxmemory set)")
    faults = ", ".join(f"{k} {v}" for k, v in sorted(c["errors"].items()) if v) or "none"
    return [
        ("cluster", f"{'up' if c['up'] else 'UNREACHABLE'}; memory {memory}"),
        ("", f"hits {c.get('hit_blocks', 0)} blocks, misses {c.get('miss_blocks', 0)}; "
             f"read {fmt_bytes(c.get('read_bytes', 0))}, written "
             f"{fmt_bytes(c.get('written_bytes', 0))} ({c.get('written_blocks', 0)} blocks)"),
        ("", f"dropped writes {c.get('dropped_writes', 0)}, corrupt values "
             f"{c.get('corrupt_values', 0)}, vanished {c.get('vanished_blocks', 0)}; "
             f"timeouts {c.get('timeouts', 0)}, skipped calls {c.get('skipped_calls', 0)}, "
             f"reconnects {c.get('reconnects', 0)}"),
        ("", f"errors: {faults}"),
    ]


def render_status(d: dict[str, Any]) -> str:
    rate = (f"{fmt_pct(d['hit_rate'])} of {d['lookup_tokens']} tokens asked beyond the "
            f"engines' caches; {fmt_pct(d['prompt_hit_rate'])} of {d['prompt_tokens']} "
            "prompt tokens")
    rows = [("version", d["version"] or "?"), ("uptime", fmt_uptime(d["uptime_seconds"])),
            ("health", d["health"]), ("policy", d["eviction_policy"] or "?"),
            ("sessions", d["sessions"]), ("leases", d["leases"]),
            ("reservations", d["reservations"]), ("namespaces", d["namespaces"]),
            ("lookups", f"{d['lookups']} ({d['lookup_keys']} keys)"),
            ("loaded", f"{d['hit_blocks']} blocks, {d['hit_tokens']} tokens"),
            ("hit rate", rate)]
    if d.get("cluster"):
        rows += render_cluster(d["cluster"])
    lines = [f"kvkeeper daemon at {d['url']}"]
    lines += [f"  {k:<14}{v}" for k, v in rows]
    if d["tiers"]:
        head = ("tier", "capacity", "used", "pinned", "evictable", "blocks", "pending",
                "evictions")
        cells = [head]
        for t in d["tiers"]:
            cap = t["capacity_bytes"]
            used = fmt_bytes(t["used_bytes"]) + (
                f" ({100 * t['used_bytes'] / cap:.0f}%)" if cap else "")
            cells.append((t["tier"], fmt_bytes(cap) if cap else "-", used, fmt_bytes(t["pinned_bytes"]),
                          fmt_bytes(t["evictable_bytes"]), str(t["blocks"]),
                          str(t["pending_blocks"]), str(t["evictions"])))
        lines.append("")
        lines += ["  " + line
                  for line in table(cells, right=frozenset(range(1, len(head)))).splitlines()]
    if d.get("engines"):
        cells = [("gpu engine", "namespace", "resident", "bytes", "capacity", "instance")]
        for e in d["engines"]:
            cells.append((e["engine"], e["namespace_id"][:12], str(e["resident_blocks"]),
                          fmt_bytes(e["resident_bytes"]), str(e["capacity_blocks"]),
                          e["instance_id"]))
        lines.append("")
        lines += ["  " + line for line in table(cells, right=frozenset({2, 3, 4})).splitlines()]
    return "\n".join(lines) + "\n"


def _health(channel: Any, timeout: Optional[float]) -> str:
    try:
        resp = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=timeout)
    except grpc.RpcError as e:
        if e.code() == grpc.StatusCode.UNIMPLEMENTED:
            return "unknown (no health service)"
        if e.code() == grpc.StatusCode.NOT_FOUND:
            return "unknown"
        return f"unknown ({e.code().name})"
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def _stats_failure(e: grpc.RpcError, target: Target) -> str:
    code = e.code()
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
        return (f"cannot reach the daemon at {target.where}: {code.name}: {e.details()}; "
                "is `kvkeeper serve` running?")
    return f"the daemon at {target.where} failed Stats: {code.name}: {e.details()}"


def cmd_status(args: argparse.Namespace) -> int:
    def ask(channel: Any, timeout: Optional[float]) -> tuple[Any, str]:
        stats = kvkeeper_pb2_grpc.KVKeeperStub(channel).Stats(
            kvkeeper_pb2.StatsRequest(), timeout=timeout)
        return stats, _health(channel, timeout)

    def show(answer: tuple[Any, str], target: Target) -> int:
        d = status_dict(*answer, target.url)
        if args.json:
            print_json(d)
        else:
            sys.stdout.write(render_status(d))
        return 0

    return call_daemon(args, ask, show, _stats_failure)
