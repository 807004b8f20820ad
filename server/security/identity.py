"""Who is calling: the identity a session belongs to.

    token:<name>     a bearer token of auth.tokens_file (its name, never the token)
    mtls:<subject>   a client certificate that mutual TLS verified, without a token
    socket           the unix socket without a token: one trust domain (see auth.py)
    tcp              plain TCP where nothing authenticates callers (loopback)

The auth interceptor, when there is one, decides the caller once per call and
hands the identity to the handler through CURRENT (each RPC runs in a task of
its own, so the value never leaks between calls). Without an interceptor the
identity follows from the connection alone (for_connection).
"""
from __future__ import annotations

import hashlib
from contextvars import ContextVar
from typing import Any, Optional

from ..ids import Identity

SOCKET = Identity("socket")
TCP = Identity("tcp")
TOKEN_PREFIX = "token:"
MTLS_PREFIX = "mtls:"

CURRENT: ContextVar[Optional[Identity]] = ContextVar("kvkeeper_identity", default=None)


def for_token(name: str) -> Identity:
    return Identity(TOKEN_PREFIX + name)


def tls_subject(context: Any) -> Optional[str]:
    """The verified client certificate's subject (its common name when grpc gives no
    subject, else a digest of the certificate); None without a client certificate."""
    ac = context.auth_context() or {}
    if b"ssl" not in ac.get("transport_security_type", ()):
        return None
    for key in ("x509_subject", "x509_common_name"):
        values = ac.get(key)
        if values:
            return b",".join(values).decode("utf-8", "replace")
    pem = ac.get("x509_pem_cert")
    if pem:
        return "sha256:" + hashlib.sha256(pem[0]).hexdigest()
    return None


def for_connection(context: Any) -> Identity:
    """The identity of a caller that presented no token."""
    if (context.peer() or "").startswith("unix:"):
        return SOCKET
    subject = tls_subject(context)
    return Identity(MTLS_PREFIX + subject) if subject else TCP


def of(context: Any) -> Identity:
    """The calling identity: the interceptor's decision, else the connection's."""
    ident = CURRENT.get()
    return ident if ident is not None else for_connection(context)
