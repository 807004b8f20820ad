"""How a `kvkeeper` command (status, ls, inspect, evict, drain, verify) reaches the daemon.

--url takes what the client library takes (kvkeeper.client.url: unix:///abs/path,
unix://rel/path, unix:path, a path with a '/', host:port, tcp://host:port, [v6]:port,
dns:///host:port), so $KVKEEPER_URL names the same daemon for the CLI, the client and
the connector; the default is unix://./kvkeeper.sock. Credentials come from
--token-file or $KVKEEPER_TOKEN (never a flag with the token itself: it would show in
`ps`), and TLS from --tls / --tls-ca / --tls-cert / --tls-key.
"""
from __future__ import annotations

import argparse
import os
from dataclasses import dataclass
from typing import Any, Callable, Optional, TypeVar

import grpc

from kvkeeper.client.auth import TLS, bearer_metadata, channel_credentials
from kvkeeper.client.url import parse_url

from ..config import parse_duration
from .format import err

DEFAULT_URL = "unix://./kvkeeper.sock"
URL_ENV = "KVKEEPER_URL"
TOKEN_ENV = "KVKEEPER_TOKEN"

T = TypeVar("T")


class CommandError(Exception):
    """A command cannot go on; `exit_code` is its exit status, the message goes to stderr."""
    exit_code = 1


class UsageError(CommandError):
    """A bad argument: exit status 2."""
    exit_code = 2


class Unreachable(CommandError):
    """No daemon where --url points: exit status 1."""


def duration_arg(text: str) -> float:
    """An argparse type: seconds, or a duration like "30s", "2m"."""
    try:
        return parse_duration(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def add_credential_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--token-file", metavar="FILE",
                   help=f"file holding the bearer token (default: ${TOKEN_ENV})")
    p.add_argument("--tls", action="store_true", help="connect with TLS (TCP only)")
    p.add_argument("--tls-ca", metavar="FILE", help="PEM CA bundle of the daemon's certificate "
                   "(implies --tls; default: the system's roots)")
    p.add_argument("--tls-cert", metavar="FILE", help="PEM client certificate (mutual TLS)")
    p.add_argument("--tls-key", metavar="FILE", help="PEM private key of --tls-cert")


def add_connection_args(p: argparse.ArgumentParser) -> None:
    """--url, --json, --timeout and the credentials: what every daemon command takes."""
    p.add_argument("--url", default=None,
                   help=f"unix:///abs/path, unix://rel/path or host:port "
                        f"(default: ${URL_ENV} or {DEFAULT_URL})")
    p.add_argument("--json", action="store_true", help="print JSON")
    p.add_argument("--timeout", type=duration_arg, default=5.0, metavar="SECONDS",
                   help="RPC deadline (default 5s)")
    add_credential_args(p)


def grpc_target(url: str, cwd: Optional[str] = None) -> tuple[str, Optional[str]]:
    """(grpc target, unix socket path or None) for a --url. ValueError when malformed.

    The grammar is the client's (kvkeeper.client.url.parse_url); a relative socket path is
    made absolute against `cwd` here, so that messages name the file the command looked for."""
    try:
        parsed = parse_url(url)
    except ValueError as e:
        raise ValueError(f"--url: {e}") from None
    if parsed.path is None:
        return parsed.target, None
    path = os.path.normpath(os.path.join(cwd or os.getcwd(), parsed.path))
    return "unix://" + path, path


@dataclass(frozen=True)
class Target:
    url: str
    target: str              # what grpc dials
    path: Optional[str]      # the unix socket, if it is one
    where: str               # the daemon's address for messages


def resolve_target(args: argparse.Namespace) -> Target:
    """The daemon --url names. UsageError when malformed, Unreachable when the socket is missing."""
    url = args.url or os.environ.get(URL_ENV) or DEFAULT_URL
    try:
        target, path = grpc_target(url)
    except ValueError as e:
        raise UsageError(str(e)) from None
    where = f"{url} ({path})" if path and path not in url else url
    if path is not None and not os.path.exists(path):
        raise Unreachable(f"cannot reach the daemon at {where}: no socket at {path}; "
                          "is `kvkeeper serve` running, and is --url (or $KVKEEPER_URL) right?")
    return Target(url, target, path, where)


def read_token(args: argparse.Namespace) -> Optional[str]:
    path = getattr(args, "token_file", None)
    if path:
        try:
            with open(path, encoding="utf-8") as fh:
                token = fh.read().strip()
        except OSError as e:
            raise UsageError(f"--token-file {path}: {e.strerror or e}") from None
        if not token:
            raise UsageError(f"--token-file {path} is empty")
        return token
    return os.environ.get(TOKEN_ENV) or None


def tls_of(args: argparse.Namespace) -> Optional[TLS]:
    ca, cert, key = (getattr(args, n, None) for n in ("tls_ca", "tls_cert", "tls_key"))
    if not (getattr(args, "tls", False) or ca or cert or key):
        return None
    try:
        return TLS(ca_file=ca, cert_file=cert, key_file=key)
    except ValueError:
        raise UsageError("--tls-cert and --tls-key go together") from None


class _Metadata(grpc.UnaryUnaryClientInterceptor, grpc.UnaryStreamClientInterceptor):
    """Adds the bearer token to every call of a blocking channel."""

    def __init__(self, metadata: Any) -> None:
        self.metadata = metadata

    def _details(self, details: Any) -> Any:
        class Details(grpc.ClientCallDetails):
            pass
        d = Details()
        d.method, d.timeout, d.credentials = details.method, details.timeout, details.credentials
        d.metadata = list(details.metadata or ()) + list(self.metadata)
        d.wait_for_ready = getattr(details, "wait_for_ready", None)
        d.compression = getattr(details, "compression", None)
        return d

    def intercept_unary_unary(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)

    def intercept_unary_stream(self, continuation: Any, details: Any, request: Any) -> Any:
        return continuation(self._details(details), request)


def open_channel(target: Target, args: argparse.Namespace) -> grpc.Channel:
    """A blocking channel to `target` with the command's credentials. UsageError on bad ones."""
    try:
        metadata = bearer_metadata(read_token(args))
    except ValueError as e:
        raise UsageError(f"the token: {e}") from None
    tls = tls_of(args)
    if tls is not None and target.path is not None:
        raise UsageError("--tls is for TCP addresses; the daemon's unix socket is plain")
    try:
        creds = channel_credentials(tls)
    except OSError as e:
        raise UsageError(f"TLS file {e.filename}: {e.strerror or e}") from None
    channel = (grpc.secure_channel(target.target, creds) if creds is not None
               else grpc.insecure_channel(target.target))
    if metadata:
        channel = grpc.intercept_channel(channel, _Metadata(metadata))
    return channel


def connect(args: argparse.Namespace) -> tuple[Target, grpc.Channel]:
    """The target --url names and a channel to it. UsageError, Unreachable."""
    target = resolve_target(args)
    return target, open_channel(target, args)


def call_daemon(args: argparse.Namespace, rpc: Callable[[grpc.Channel, Optional[float]], T],
                show: Callable[[T, Target], int],
                failure: Callable[[grpc.RpcError, Target], str]) -> int:
    """A command's exit status: rpc(channel, --timeout) against --url, its answer handed to
    show(); a bad argument, a missing socket or a failed RPC (worded by failure()) go to
    stderr instead."""
    try:
        target, channel = connect(args)
    except CommandError as e:
        err(str(e))
        return e.exit_code
    with channel:
        try:
            answer = rpc(channel, args.timeout)
        except grpc.RpcError as e:
            err(failure(e, target))
            return 1
        return show(answer, target)
