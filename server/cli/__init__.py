"""The `kvkeeper` command: serve, status, the admin commands, bench, version.

    kvkeeper serve [--config FILE] [--socket PATH] [--tcp HOST:PORT] [--metrics HOST:PORT]
                   [--capacity SIZE] [--page-size SIZE] [--policy NAME] [--log-level LEVEL]
                   [--log-format text|json] [--set SECTION.KEY=VALUE ...]
                   [--print-config [toml|json]]
    kvkeeper status [--url URL] [--json] [--timeout SECONDS] [--token-file FILE] [--tls ...]
    kvkeeper ls | inspect | evict | drain | verify   (admin.py)
    kvkeeper bench ARGS...      (forwarded to kvkeeper.server.bench.main)
    kvkeeper experiment {prefix,report} ARGS...   (kvkeeper.server.experiment)
    kvkeeper verify replay ARGS...                (kvkeeper.server.experiment.replay)
    kvkeeper version

Exit codes: 0 success; 1 runtime failure (daemon unreachable, bench unavailable);
2 usage or configuration error.

The package, by concept: main (the parser and the dispatch), serve, status, admin (the
operator commands), channel (--url, credentials, the channel to the daemon), format
(how the commands print).
"""
from .channel import grpc_target
from .main import build_parser, main
from .status import render_status, status_dict

__all__ = ["build_parser", "grpc_target", "main", "render_status", "status_dict"]
