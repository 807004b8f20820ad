"""`kvkeeper serve`: the daemon's flags, the configuration they make, and the run."""
from __future__ import annotations

import argparse
import os
import sys
from typing import Any

from ..config import (CLI_FLAGS, ConfigError, describe_precedence, load_config, render_json,
                      render_toml)
from .format import err

# dest of each dedicated serve flag -> "section.key"
_SERVE_FLAG_DEST = {flag.lstrip("-").replace("-", "_"): key for key, flag in CLI_FLAGS.items()}
_FLAG_HELP = {
    "--socket": "unix socket path (\"\" disables)",
    "--tcp": "TCP HOST:PORT for gRPC (\"\" disables)",
    "--metrics": "Prometheus HOST:PORT (\"\" disables)",
    "--capacity": "host tier size, e.g. 8GiB",
    "--page-size": "page size, a multiple of 4096, e.g. 64KiB",
    "--policy": "eviction policy: s3fifo (default), hits-lru or lru",
    "--log-level": "debug, info, warning, error or critical",
    "--log-format": "text or json (one JSON object per line)",
    "--cluster-url": "Redis/Valkey below the disk: redis://H:P, rediss://H:P (TLS) or "
                     "redis+cluster://H:P,H:P (\"\" disables)",
}
_FLAG_METAVAR = {"--socket": "PATH", "--tcp": "HOST:PORT", "--metrics": "HOST:PORT",
                 "--capacity": "SIZE", "--page-size": "SIZE", "--policy": "NAME",
                 "--log-level": "LEVEL", "--log-format": "FORMAT", "--cluster-url": "URL"}


def add_command(sub: Any) -> None:
    """Register `serve` on the `kvkeeper` subparsers."""
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
        err(f"config error: {e}")
        return 2
    if args.print_config:
        sys.stdout.write(render_json(config) if args.print_config == "json"
                         else render_toml(config))
        return 0
    # Lazy: the grpc servers and shared memory load here, not for --print-config or --help.
    from ..ops.process import run

    def reload() -> Any:
        # SIGHUP: the same sources as at start-up, read again.
        return load_config(args.config, os.environ, overrides, override_sources=labels)

    rc = run(config, reload)
    return int(rc or 0)
