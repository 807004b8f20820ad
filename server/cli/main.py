"""The `kvkeeper` entry point: the parser of every command, and the dispatch.

bench, experiment and `verify replay` parse their own arguments: main() hands them
the rest of the command line before this parser sees it.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import sys
from typing import Optional, Sequence

from ..version import package_version
from . import admin, route, serve, status
from .format import err


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvkeeper", description="A KV-cache store shared by vLLM instances over gRPC.")
    parser.add_argument("--version", action="version", version=f"kvkeeper {package_version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    serve.add_command(sub)
    status.add_command(sub)
    admin.add_commands(sub)
    route.add_command(sub)
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


def cmd_bench(argv: list[str]) -> int:
    """`kvkeeper bench ARGS...`: kvkeeper.server.bench's main(argv), imported only now (the
    benchmarks are not needed to serve)."""
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
        err(f"bench is not available: {e}")
        return 1
    return int(entry(argv) or 0)


def cmd_version(args: argparse.Namespace) -> int:
    print(f"kvkeeper {package_version()}")
    return 0
