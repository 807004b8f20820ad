"""Daemon addresses, as users write them, turned into gRPC channel targets.

Deployments name the daemon in a vLLM config string, `kvkeeper status --url` or
$KVKEEPER_URL, and all of them go through parse_url, so one URL means one daemon
everywhere. The accepted forms are few and checked up front: a typo should fail at
startup with a message that shows the accepted forms, not later as a vague
UNAVAILABLE from the channel.

    unix:///abs/path   unix://rel/path   unix:path     -> unix socket
    ./rel/path         /abs/path  (any path with "/") -> unix socket
    host:port          [::1]:port   tcp://host:port    -> TCP, resolved by gRPC
    dns:///host:port                                   -> TCP via gRPC's DNS resolver

A socket path may start with "~" (the user's home). parse_host_port is the one parser
of "host:port" for the whole project: the daemon's listen and metrics addresses too.
"""
from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass
from typing import Optional

__all__ = ["KeeperURL", "parse_host_port", "parse_url", "to_grpc_target"]

_FORMS = ("unix:///abs/path, unix://rel/path, unix:path, a path with a '/' (./kvkeeper.sock), "
          "host:port, tcp://host:port, [ipv6]:port or dns:///host:port")
# RFC 1123 host names (labels of letters, digits, '-', '_' tolerated), or IPv4.
_HOST_RE = re.compile(r"^(?=.{1,253}$)[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?"
                      r"(\.[A-Za-z0-9_]([A-Za-z0-9_-]{0,61}[A-Za-z0-9_])?)*\.?$")


@dataclass(frozen=True)
class KeeperURL:
    """A parsed daemon address. `target` is what grpc.aio.insecure_channel takes."""

    kind: str                    # "unix" or "tcp"
    target: str
    path: Optional[str] = None   # unix socket path (relative paths stay relative)
    host: Optional[str] = None   # tcp host, without brackets
    port: Optional[int] = None


def _bad(url: str, why: str) -> ValueError:
    return ValueError(f"invalid kvkeeper URL {url!r}: {why}; expected one of {_FORMS}")


def parse_host_port(text: str, *, any_port: bool = False) -> tuple[str, int]:
    """(host, port) from "host:port" or "[ipv6]:port"; the host comes without brackets.

    any_port: port 0 is allowed (a listener binding any free port); a daemon to dial
    needs 1..65535. ValueError saying only what is wrong: callers add which value it was."""
    lo = 0 if any_port else 1
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise ValueError("unclosed '[': write an IPv6 address in brackets, e.g. [::1]:50051")
        host, rest = text[1:end], text[end + 1:]
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise ValueError(f"{host!r} is not an IPv6 address") from None
        if not rest.startswith(":"):
            raise ValueError("missing ':port' after the IPv6 address")
        port_text = rest[1:]
    else:
        host, sep, port_text = text.rpartition(":")
        if not sep:
            raise ValueError("missing ':port'")
        if ":" in host or "]" in host:
            raise ValueError("an IPv6 address must be written in brackets, e.g. [::1]:50051")
        if not host:
            raise ValueError("missing host")
        if not _HOST_RE.match(host):
            raise ValueError(f"{host!r} is not a valid host name")
    if not port_text.isdigit():
        raise ValueError(f"port {port_text!r} is not a number")
    port = int(port_text)
    if not lo <= port < 65536:
        raise ValueError(f"port {port} is outside {lo}..65535")
    return host, port


def _parse_hostport(url: str, text: str, scheme: str) -> KeeperURL:
    try:
        host, port = parse_host_port(text)
    except ValueError as e:
        raise _bad(url, str(e)) from None
    shown = f"[{host}]" if ":" in host else host
    return KeeperURL("tcp", f"{scheme}{shown}:{port}", host=host, port=port)


def _unix(url: str, path: str) -> KeeperURL:
    if not path or path.endswith("/"):
        raise _bad(url, "missing socket path")
    if "\x00" in path:
        raise _bad(url, "NUL in socket path")
    path = os.path.expanduser(path)
    # gRPC reads "unix:PATH" as relative or absolute; "unix://rel" it would not.
    return KeeperURL("unix", f"unix:{path}", path=path)


def parse_url(url: str) -> KeeperURL:
    """Parse a daemon URL (forms in the module docstring); ValueError if invalid."""
    if not isinstance(url, str):
        raise ValueError(f"kvkeeper URL must be a str, got {type(url).__name__}")
    if not url or url != url.strip() or any(c.isspace() for c in url):
        raise _bad(url, "empty or contains whitespace")
    if url.startswith("unix:"):
        rest = url[len("unix:"):]
        if rest.startswith("//"):
            rest = rest[2:]  # unix:///abs -> /abs ; unix://rel/path -> rel/path
        return _unix(url, rest)
    if url.startswith("dns:"):
        rest = url[len("dns:"):]
        if not rest.startswith("///"):
            raise _bad(url, "dns URLs are written dns:///host:port (no authority)")
        return _parse_hostport(url, rest[3:], "dns:///")
    if url.startswith("tcp://"):
        return _parse_hostport(url, url[len("tcp://"):], "")
    if "://" in url:
        raise _bad(url, f"unsupported scheme {url.split('://', 1)[0]!r}")
    if "/" in url:  # no host name holds a '/': a socket path, as a shell writes it
        return _unix(url, url)
    return _parse_hostport(url, url, "")


def to_grpc_target(url: str) -> str:
    """The gRPC channel target for a daemon URL; ValueError if invalid."""
    return parse_url(url).target
