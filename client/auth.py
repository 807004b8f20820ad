"""Credentials a client presents: a bearer token and TLS.

The token travels as call metadata (`authorization: Bearer <token>`) on every
call, so it works over plain TCP and the unix socket too; the daemon rejects
a wrong one with UNAUTHENTICATED. Over plain TCP beyond loopback the token
is readable on the network: use TLS there.

TLS is chosen by the caller, not by the URL: `tls=True` trusts the system's
roots, `tls=TLS(ca_file=..., cert_file=..., key_file=...)` names a CA bundle
and, for mutual TLS, the client's certificate and key.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Optional, Sequence, Tuple, Union

import grpc

__all__ = ["TLS", "TLSLike", "bearer_metadata", "channel_credentials", "aio_channel",
           "sync_channel"]


@dataclass(frozen=True)
class TLS:
    ca_file: Optional[str] = None     # PEM roots that signed the daemon's certificate; None: system
    cert_file: Optional[str] = None   # PEM client certificate chain (mutual TLS)
    key_file: Optional[str] = None    # its private key

    def __post_init__(self) -> None:
        if bool(self.cert_file) != bool(self.key_file):
            raise ValueError("TLS: cert_file and key_file go together")


TLSLike = Union[None, bool, TLS]


def bearer_metadata(token: Optional[str]) -> Optional[Tuple[Tuple[str, str], ...]]:
    """Call metadata carrying `token`, or None. ValueError for a token no header can carry."""
    if token is None:
        return None
    if not isinstance(token, str) or not token or token != token.strip() or \
            any(not c.isprintable() or c.isspace() for c in token):
        raise ValueError("token must be a non-empty string without whitespace")
    return (("authorization", f"Bearer {token}"),)


def _read(path: Optional[str]) -> Optional[bytes]:
    if not path:
        return None
    with open(path, "rb") as fh:
        return fh.read()


def channel_credentials(tls: TLSLike) -> Optional[grpc.ChannelCredentials]:
    """None for a plain channel; OSError when a named file cannot be read."""
    if tls is None or tls is False:
        return None
    if tls is True:
        tls = TLS()
    if not isinstance(tls, TLS):
        raise ValueError(f"tls must be None, a bool or a kvkeeper.client.auth.TLS, got {tls!r}")
    return grpc.ssl_channel_credentials(root_certificates=_read(tls.ca_file),
                                        private_key=_read(tls.key_file),
                                        certificate_chain=_read(tls.cert_file))


def _channel(kind: Any, target: str, tls: TLSLike, options: Sequence[Tuple[str, Any]]) -> Any:
    creds = channel_credentials(tls)
    if creds is None:
        return kind.insecure_channel(target, options=options)
    if target.startswith("unix:"):
        raise ValueError("TLS is for TCP addresses; the daemon's unix socket is plain")
    return kind.secure_channel(target, creds, options=options)


def aio_channel(target: str, tls: TLSLike, options: Sequence[Tuple[str, Any]]) -> grpc.aio.Channel:
    return _channel(grpc.aio, target, tls, options)


def sync_channel(target: str, tls: TLSLike, options: Sequence[Tuple[str, Any]]) -> grpc.Channel:
    """A blocking channel, for streams read in the calling thread (Client.load_chunks)."""
    return _channel(grpc, target, tls, options)
