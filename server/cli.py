"""The `kvkeeper` command: serve, status, the admin commands, bench, version.

    kvkeeper serve [--config FILE] [--socket PATH] [--tcp HOST:PORT] [--metrics HOST:PORT]
                   [--capacity SIZE] [--page-size SIZE] [--policy NAME] [--log-level LEVEL]
                   [--log-format text|json] [--set SECTION.KEY=VALUE ...]
                   [--print-config [toml|json]]
    kvkeeper status [--url URL] [--json] [--timeout SECONDS] [--token-file FILE] [--tls ...]
    kvkeeper ls | inspect | evict | drain | verify   (admin_cli.py)
    kvkeeper bench ARGS...      (forwarded to kvkeeper.server.bench.main)
    kvkeeper experiment {prefix,report} ARGS...   (kvkeeper.server.experiment)
    kvkeeper verify replay ARGS...                (kvkeeper.server.experiment.replay)
    kvkeeper version

Exit codes: 0 success; 1 runtime failure (daemon unreachable, bench unavailable);
2 usage or configuration error.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any, Optional, Sequence

from .config import (CLI_FLAGS, ConfigError, describe_precedence, load_config, parse_address,
                     parse_duration, render_json, render_toml)

DEFAULT_URL = "unix://./kvkeeper.sock"
URL_ENV = "KVKEEPER_URL"


def package_version() -> str:
    from importlib.metadata import PackageNotFoundError, version
    try:
        return version("kvkeeper")
    except PackageNotFoundError:
        return "unknown"


def _err(msg: str) -> None:
    print(f"kvkeeper: {msg}", file=sys.stderr)


# --------------------------------------------------------------------------- parser
# dest of each dedicated serve flag -> "section.key"
_SERVE_FLAG_DEST = {flag.lstrip("-").replace("-", "_"): key for key, flag in CLI_FLAGS.items()}
_FLAG_HELP = {
    "--socket": "unix socket path (\"\" disables)",
    "--tcp": "TCP HOST:PORT for gRPC (\"\" disables)",
    "--metrics": "Prometheus HOST:PORT (\"\" disables)",
    "--capacity": "host tier size, e.g. 8GiB",
    "--page-size": "page size, a multiple of 4096, e.g. 64KiB",
    "--policy": "eviction policy: lru or hits-lru",
    "--log-level": "debug, info, warning, error or critical",
    "--log-format": "text or json (one JSON object per line)",
}
_FLAG_METAVAR = {"--socket": "PATH", "--tcp": "HOST:PORT", "--metrics": "HOST:PORT",
                 "--capacity": "SIZE", "--page-size": "SIZE", "--policy": "NAME",
                 "--log-level": "LEVEL", "--log-format": "FORMAT"}


def _duration_arg(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvkeeper", description="A KV-cache store shared by vLLM instances over gRPC.")
    parser.add_argument("--version", action="version", version=f"kvkeeper {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")

    serve = sub.add_parser("serve", help="run the daemon",
                           formatter_class=argparse.RawDescriptionHelpFormatter,
                           epilog=describe_precedence())
    serve.add_argument("--config", metavar="FILE",
                       help="TOML config file (default: $KVKEEPER_CONFIG)")
    for key, flag in CLI_FLAGS.items():
        serve.add_argument(flag, metavar=_FLAG_METAVAR.get(flag), default=None,
                           help=f"{_FLAG_HELP.get(flag, key)} [{key}]")
    serve.add_argument("--set", metavar="SECTION.KEY=VALUE", action="append", default=[],
                       help="set any config key; repeatable")
    serve.add_argument("--print-config", nargs="?", const="toml", choices=("toml", "json"),
                       help="print the effective configuration and exit")
    serve.set_defaults(func=cmd_serve)

    status = sub.add_parser("status", help="show a running daemon's state")
    status.add_argument("--url", default=None,
                        help=f"unix:///abs/path, unix://rel/path or host:port "
                             f"(default: ${URL_ENV} or {DEFAULT_URL})")
    status.add_argument("--json", action="store_true", help="print JSON")
    status.add_argument("--timeout", type=_duration_arg, default=5.0, metavar="SECONDS",
                        help="RPC deadline (default 5s)")
    from .cli_channel import add_credential_args
    add_credential_args(status)
    status.set_defaults(func=cmd_status)

    from .admin_cli import add_commands
    add_commands(sub)

    sub.add_parser("bench", help="run the benchmark (kvkeeper bench --help)", add_help=False)
    sub.add_parser("experiment", add_help=False,
                   help="unique vs shared prefix on a vLLM server (kvkeeper experiment --help)")

    version = sub.add_parser("version", help="print the version")
    version.set_defaults(func=cmd_version)
    return parser


def main(argv: Optional[Sequence[str]] = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv and argv[0] == "bench":
        return cmd_bench(argv[1:])
    # Client-side checks of a live vLLM server: loaded only when asked for.
    if argv and argv[0] == "experiment":
        from kvkeeper.server.experiment import main as experiment_main
        return experiment_main(argv[1:])
    if argv[:2] == ["verify", "replay"]:
        from kvkeeper.server.experiment.replay import main as replay_main
        return replay_main(argv[2:])
    parser = build_parser()
    try:
        args = parser.parse_args(argv)
    except SystemExit as e:  # --help, --version, usage errors
        return e.code if isinstance(e.code, int) else (0 if e.code is None else 2)
    if getattr(args, "func", None) is None:
        parser.print_help(sys.stderr)
        return 2
    return args.func(args)


# --------------------------------------------------------------------------- serve
def serve_overrides(args: argparse.Namespace) -> tuple[dict[str, Any], dict[str, str]]:
    """({"section.key": value}, {"section.key": source label}) from the serve flags.
    Dedicated flags win over --set; a later --set wins over an earlier one."""
    overrides: dict[str, Any] = {}
    labels: dict[str, str] = {}
    for item in args.set:
        key, eq, value = item.partition("=")
        key = key.strip()
        if not eq or "." not in key:
            raise ConfigError(f"--set expects SECTION.KEY=VALUE (e.g. host_tier.name=kv0), "
                              f"got {item!r}", source="flag --set")
        overrides[key] = value
        labels[key] = f"flag --set {key}"
    for dest, key in _SERVE_FLAG_DEST.items():
        value = getattr(args, dest)
        if value is not None:
            overrides[key] = value
            labels[key] = f"flag {CLI_FLAGS[key]}"
    return overrides, labels


def cmd_serve(args: argparse.Namespace) -> int:
    try:
        overrides, labels = serve_overrides(args)
        config = load_config(args.config, os.environ, overrides, override_sources=labels)
    except ConfigError as e:
        _err(f"config error: {e}")
        return 2
    if args.print_config:
        sys.stdout.write(render_json(config) if args.print_config == "json"
                         else render_toml(config))
        return 0
    from kvkeeper.server.app import run  # lazy: grpc servers and shared memory load here

    def reload() -> Any:
        # SIGHUP: the same sources as at start-up, read again.
        return load_config(args.config, os.environ, overrides, override_sources=labels)

    rc = run(config, reload)
    return int(rc or 0)


# --------------------------------------------------------------------------- status
def grpc_target(url: str, cwd: Optional[str] = None) -> tuple[str, Optional[str]]:
    """(grpc target, unix socket path or None) for a --url. ValueError when malformed.

    "unix:///abs/path", "unix://rel/path", "unix:path" and a bare path containing "/"
    name a unix socket (relative paths against `cwd`); "host:port" (optionally "tcp://" or
    "grpc://" in front) names a TCP address."""
    cwd = cwd or os.getcwd()
    path = None
    if url.startswith("unix://"):
        path = url[len("unix://"):]
    elif url.startswith("unix:"):
        path = url[len("unix:"):]
    elif "://" not in url and "/" in url:
        path = url
    if path is not None:
        if not path:
            raise ValueError(f"--url {url!r} names no socket path")
        path = os.path.normpath(os.path.join(cwd, os.path.expanduser(path)))
        return "unix://" + path, path
    for scheme in ("tcp://", "grpc://", "dns:///"):
        if url.startswith(scheme):
            url = url[len(scheme):]
            break
    if "://" in url:
        raise ValueError(f"--url {url!r}: unsupported scheme; use unix:///abs/path, "
                         "unix://rel/path or host:port")
    try:
        parse_address(url)
    except ValueError as e:
        raise ValueError(f"--url {e}") from None
    return url, None


def _fmt_bytes(n: int) -> str:
    for unit, size in (("TiB", 1 << 40), ("GiB", 1 << 30), ("MiB", 1 << 20), ("KiB", 1 << 10)):
        if n >= size:
            return f"{n / size:.1f} {unit}"
    return f"{n} B"


def _fmt_uptime(s: float) -> str:
    s = int(s)
    d, s = divmod(s, 86400)
    h, s = divmod(s, 3600)
    m, s = divmod(s, 60)
    if d:
        return f"{d}d {h:02d}h {m:02d}m {s:02d}s"
    if h:
        return f"{h}h {m:02d}m {s:02d}s"
    return f"{m}m {s:02d}s" if m else f"{s}s"


def _tier_name(pb2: Any, tier: int) -> str:
    try:
        name = pb2.Tier.Name(tier)
    except ValueError:
        return str(tier)
    return name[len("TIER_"):].lower() if name.startswith("TIER_") else name.lower()


_TIER_FIELDS = ("capacity_bytes", "used_bytes", "pinned_bytes", "evictable_bytes",
                "capacity_pages", "used_pages", "blocks", "pending_blocks", "evictions",
                "hit_blocks")
_STAT_FIELDS = ("sessions", "leases", "reservations", "namespaces", "lookups", "lookup_keys",
                "hit_blocks", "hit_tokens", "lookup_blocks", "lookup_tokens", "prompt_blocks",
                "prompt_tokens")


def status_dict(stats: Any, health: str, url: str) -> dict[str, Any]:
    """A StatsResponse (plus the health status) as plain JSON-able values."""
    from kvkeeper.v1 import kvkeeper_pb2 as pb2
    d: dict[str, Any] = {"url": url, "version": stats.version,
                         "uptime_seconds": stats.uptime_seconds, "health": health,
                         "eviction_policy": stats.eviction_policy}
    d.update({k: getattr(stats, k) for k in _STAT_FIELDS})
    # Of the tokens asked beyond the engines' own prefix caches, and of whole
    # prompts: what the engines really loaded (see server/ledger/usage.py).
    d["hit_rate"] = stats.hit_tokens / stats.lookup_tokens if stats.lookup_tokens else None
    d["prompt_hit_rate"] = (stats.hit_tokens / stats.prompt_tokens if stats.prompt_tokens
                            else None)
    d["tiers"] = [{"tier": _tier_name(pb2, t.tier), **{k: getattr(t, k) for k in _TIER_FIELDS}}
                  for t in stats.tiers]
    return d


def _pct(rate: Optional[float]) -> str:
    return "n/a" if rate is None else f"{100 * rate:.1f}%"


def render_status(d: dict[str, Any]) -> str:
    rate = (f"{_pct(d['hit_rate'])} of {d['lookup_tokens']} tokens asked beyond the engines' "
            f"caches; {_pct(d['prompt_hit_rate'])} of {d['prompt_tokens']} prompt tokens")
    rows = [("version", d["version"] or "?"), ("uptime", _fmt_uptime(d["uptime_seconds"])),
            ("health", d["health"]), ("policy", d["eviction_policy"] or "?"),
            ("sessions", d["sessions"]), ("leases", d["leases"]),
            ("reservations", d["reservations"]), ("namespaces", d["namespaces"]),
            ("lookups", f"{d['lookups']} ({d['lookup_keys']} keys)"),
            ("loaded", f"{d['hit_blocks']} blocks, {d['hit_tokens']} tokens"),
            ("hit rate", rate)]
    lines = [f"kvkeeper daemon at {d['url']}"]
    lines += [f"  {k:<14}{v}" for k, v in rows]
    if d["tiers"]:
        head = ("tier", "capacity", "used", "pinned", "evictable", "blocks", "pending",
                "evictions")
        table = [head]
        for t in d["tiers"]:
            cap = t["capacity_bytes"]
            used = _fmt_bytes(t["used_bytes"]) + (
                f" ({100 * t['used_bytes'] / cap:.0f}%)" if cap else "")
            table.append((t["tier"], _fmt_bytes(cap), used, _fmt_bytes(t["pinned_bytes"]),
                          _fmt_bytes(t["evictable_bytes"]), str(t["blocks"]),
                          str(t["pending_blocks"]), str(t["evictions"])))
        widths = [max(len(r[i]) for r in table) for i in range(len(head))]
        lines.append("")
        for r in table:
            lines.append("  " + "  ".join(c.ljust(w) if i == 0 else c.rjust(w)
                                          for i, (c, w) in enumerate(zip(r, widths))).rstrip())
    return "\n".join(lines) + "\n"


def _health(channel: Any, timeout: float) -> str:
    import grpc
    from grpc_health.v1 import health_pb2, health_pb2_grpc
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


def cmd_status(args: argparse.Namespace) -> int:
    from .cli_channel import Unreachable, UsageError, open_channel, resolve_target
    try:
        t = resolve_target(args)
        channel = open_channel(t, args)
    except UsageError as e:
        _err(str(e))
        return 2
    except Unreachable as e:
        _err(str(e))
        return 1
    url, where = t.url, t.where
    import grpc
    from kvkeeper.v1 import kvkeeper_pb2, kvkeeper_pb2_grpc
    with channel:
        try:
            stats = kvkeeper_pb2_grpc.KVKeeperStub(channel).Stats(
                kvkeeper_pb2.StatsRequest(), timeout=args.timeout)
        except grpc.RpcError as e:
            code = e.code()
            if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                _err(f"cannot reach the daemon at {where}: {code.name}: {e.details()}; "
                     "is `kvkeeper serve` running?")
            else:
                _err(f"the daemon at {where} failed Stats: {code.name}: {e.details()}")
            return 1
        health = _health(channel, args.timeout)
    d = status_dict(stats, health, url)
    if args.json:
        print(json.dumps(d, indent=2))
    else:
        sys.stdout.write(render_status(d))
    return 0


# --------------------------------------------------------------------------- bench, version
def cmd_bench(argv: list[str]) -> int:
    import importlib
    import importlib.util
    try:
        bench = importlib.import_module("kvkeeper.server.bench")
        entry = getattr(bench, "main", None)
        if entry is None and importlib.util.find_spec("kvkeeper.server.bench.main"):
            entry = importlib.import_module("kvkeeper.server.bench.main")
        if entry is not None and not callable(entry):  # a bench/main.py submodule
            entry = getattr(entry, "main", None)
        if entry is None:
            raise ImportError("kvkeeper.server.bench has no main(argv)")
    except ImportError as e:
        _err(f"bench is not available: {e}")
        return 1
    return int(entry(argv) or 0)


def cmd_version(args: argparse.Namespace) -> int:
    print(f"kvkeeper {package_version()}")
    return 0


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
