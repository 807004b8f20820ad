"""What a SIGHUP reload may change while sessions go on, and what needs a restart (pure).

Safe: settings read on every use (log level and format, the eviction-storm
threshold, the GC freeze interval), the tokens file (tokens and quotas are
swapped in one step; sessions already registered keep going) and the traffic
file (recording turned on, off or to another file: ops/traffic_file.py). Unsafe: anything bound or sized at
start-up (listeners, TLS, the arena and its pages, the disk tier, the ledger's
policy and limits, the admin service, message sizes). An unsafe change is
refused and logged with the key; the safe ones in the same file still apply.
"""
from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from ..config import SCHEMA, Config

SAFE_KEYS = frozenset({"server.log_level", "server.log_format", "server.eviction_storm_blocks",
                       "server.grace_seconds", "server.gc_freeze_interval_seconds",
                       "auth.tokens_file", "ledger.traffic_file", "ledger.traffic_requests"})

_WHY = {
    "listen": "listeners and socket permissions are set when the daemon binds",
    "metrics": "the metrics listener is bound at start-up",
    "host_tier": "the arena is created and sized at start-up",
    "disk_tier": "the disk tier is opened and sized at start-up",
    "ledger": "the ledger's policy, key size and timeouts are fixed at start-up",
    "admin": "the admin service is registered at start-up",
    "tls": "TLS credentials are bound to the TCP listener at start-up",
    "auth": "it is checked when the daemon starts",
    "server": "gRPC server options are fixed at start-up",
    "cluster_tier": "the cluster tier connects at start-up",
}


@dataclass
class ReloadPlan:
    config: Config                                   # the running config plus the safe changes
    applied: list[str] = field(default_factory=list)
    refused: list[tuple[str, str]] = field(default_factory=list)   # (key, reason)


def _get(c: Config, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(c, section), name)


def plan_reload(old: Config, new: Config) -> ReloadPlan:
    plan = ReloadPlan(old)
    for section, names in SCHEMA.items():
        for name in names:
            key = f"{section}.{name}"
            before, after = _get(old, key), _get(new, key)
            if before == after:
                continue
            if key == "auth.tokens_file" and not (before and after):
                # The interceptor that checks tokens is installed at start-up, or not at all.
                plan.refused.append((key, "turning tokens on or off needs a restart "
                                          f"({before or '(none)'} -> {after or '(none)'})"))
                continue
            if key not in SAFE_KEYS:
                plan.refused.append((key, f"needs a restart: {_WHY[section]} "
                                          f"(running {before!r}, file says {after!r})"))
                continue
            sec = getattr(plan.config, section)
            plan.config = replace(plan.config, **{section: replace(sec, **{name: after})})
            plan.applied.append(key)
    sources = dict(old.sources)
    sources.update({k: new.source_of(k) for k in plan.applied})
    plan.config = replace(plan.config, sources=sources)
    return plan
