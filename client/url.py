"""Daemon addresses, as users write them, turned into gRPC channel targets.

Deployments name the daemon in a vLLM config string, so the accepted forms are
few and checked up front: a typo should fail at startup with a message that
shows the accepted forms, not later as a vague UNAVAILABLE from the channel.

    unix:///abs/path   unix://rel/path   unix:path     -> unix socket
    host:port          [::1]:port                      -> TCP, resolved by gRPC
    dns:///host:port                                   -> TCP via gRPC's DNS resolver
"""
from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass
from typing import Optional

__all__ = ["KeeperURL", "parse_url", "to_grpc_target"]

_FORMS = ("unix:///abs/path, unix://rel/path, unix:path, host:port, "
          "[ipv6]:port or dns:///host:port")
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


def _parse_port(url: str, text: str) -> int:
    if not text.isdigit():
        raise _bad(url, f"port {text!r} is not a number")
    port = int(text)
    if not 0 < port < 65536:
        raise _bad(url, f"port {port} is outside 1..65535")
    return port


def _parse_hostport(url: str, text: str, scheme: str) -> KeeperURL:
    if text.startswith("["):
        end = text.find("]")
        if end < 0:
            raise _bad(url, "unclosed '[' in IPv6 address")
        host, rest = text[1:end], text[end + 1:]
        try:
            ipaddress.IPv6Address(host.split("%", 1)[0])
        except ValueError:
            raise _bad(url, f"{host!r} is not an IPv6 address") from None
        if not rest.startswith(":"):
            raise _bad(url, "missing ':port' after the IPv6 address")
        port = _parse_port(url, rest[1:])
        return KeeperURL("tcp", f"{scheme}[{host}]:{port}", host=host, port=port)
    host, sep, port_text = text.rpartition(":")
    if not sep:
        raise _bad(url, "missing ':port'")
    if ":" in host:
        raise _bad(url, "an IPv6 address must be written in brackets, e.g. [::1]:50051")
    if not host:
        raise _bad(url, "missing host")
    if not _HOST_RE.match(host):
        raise _bad(url, f"{host!r} is not a valid host name")
    port = _parse_port(url, port_text)
    return KeeperURL("tcp", f"{scheme}{host}:{port}", host=host, port=port)


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
        if not rest or rest.endswith("/"):
            raise _bad(url, "missing socket path")
        if "\x00" in rest:
            raise _bad(url, "NUL in socket path")
        # gRPC reads "unix:PATH" as relative or absolute; "unix://rel" it would not.
        return KeeperURL("unix", f"unix:{rest}", path=rest)
    if url.startswith("dns:"):
        rest = url[len("dns:"):]
        if not rest.startswith("///"):
            raise _bad(url, "dns URLs are written dns:///host:port (no authority)")
        return _parse_hostport(url, rest[3:], "dns:///")
    if "://" in url:
        raise _bad(url, f"unsupported scheme {url.split('://', 1)[0]!r}")
    return _parse_hostport(url, url, "")


def to_grpc_target(url: str) -> str:
    """The gRPC channel target for a daemon URL; ValueError if invalid."""
    return parse_url(url).target
