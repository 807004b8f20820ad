"""Who may call what: the listener policy, bearer tokens and mutual TLS.

Who a caller is depends on how it reached the daemon:

* a bearer token (metadata `authorization: Bearer <token>`), on any listener:
  the grant of that token in auth.tokens_file; a token nobody issued is
  UNAUTHENTICATED, never ignored;
* the unix socket without a token: trusted, as one identity ("socket"). The
  socket's mode and group (listen.socket_mode, listen.socket_group) already
  decided who may connect, and whoever may connect may also map the arena,
  which holds every namespace's bytes. Where that group is wider than one
  trust domain, auth.require_token_on_socket makes socket callers present a
  token too, so their sessions belong to their tokens;
* TCP without a token: trusted only when nothing is configured to
  authenticate TCP callers (a loopback listener, see check_exposure) or when
  mutual TLS verified the client's certificate and no tokens are defined;
  otherwise UNAUTHENTICATED.

A token limits its holder to the models it lists (RegisterSession for another
model is PERMISSION_DENIED, and every other data RPC acts inside a session's
namespace) and to the data service unless it is marked admin. Every session
belongs to the identity that registered it (identity.py): another identity
holding its id gets what an unknown id gets. grpc.health.v1 answers everyone:
probes carry no credentials.

AuthInterceptor wraps each method handler once (the wrapper is per method,
not per call) and runs the check inside the call, where the peer and the
connection's TLS state are known. Messages and logs name the token's name,
never the token.
"""
from __future__ import annotations

import ipaddress
import logging
from dataclasses import dataclass
from typing import Any, Awaitable, Callable, Optional, Sequence

import grpc

from kvkeeper.client.url import parse_host_port

from .. import errors
from ..api.status import set_status, status_for
from ..config import Config, ConfigError
from ..ids import Identity
from ..ops.ratelog import RepeatLog
from ..quoting import clip
from . import identity
from .tokens import TokenTable

log = logging.getLogger("kvkeeper.auth")

ADMIN_SERVICE = "kvkeeper.v1.KVKeeperAdmin"
OPEN_SERVICES = ("grpc.health.v1.Health",)


@dataclass(frozen=True)
class Caller:
    name: str
    models: Optional[frozenset[str]]   # None: every model
    admin: bool
    identity: Identity

    def allows_model(self, model_id: str) -> bool:
        return self.models is None or model_id in self.models


SOCKET_CALLER = Caller("unix socket", None, True, identity.SOCKET)


# ------------------------------------------------------------------ start-up policy
def is_loopback(address: str) -> bool:
    """Whether "host:port" can only be reached from this host. Names other than
    localhost count as not loopback: what they resolve to may change."""
    host, _ = parse_host_port(address, any_port=True)
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.split("%", 1)[0]).is_loopback
    except ValueError:
        return False


def check_exposure(config: Config, table: Optional[TokenTable],
                   running: Optional[TokenTable] = None) -> None:
    """ConfigError unless a TCP listener beyond loopback authenticates its callers,
    or when the socket is to require tokens that nothing defines; on a reload
    (`running`: the table in force), when the new table would turn tokens off."""
    if running is not None and running.grants and table is not None and not table.grants:
        # A tokens file with no token means no authentication (a file of quotas
        # alone): revoking every token must not open the listeners instead.
        raise ConfigError(
            "the tokens file now defines no token, which would turn authentication off "
            "(TCP callers without a token would be let in); to revoke every token, keep one "
            "that nobody holds, or restart without auth.tokens_file", key="auth.tokens_file")
    if config.auth.require_token_on_socket and (table is None or not table.grants):
        raise ConfigError(
            "auth.require_token_on_socket = true (from "
            f"{config.source_of('auth.require_token_on_socket')}) but "
            + ("auth.tokens_file defines no token" if table is not None
               else "there is no auth.tokens_file")
            + ": no socket caller could connect; set auth.tokens_file or turn the option off",
            key="auth.require_token_on_socket",
            source=config.source_of("auth.require_token_on_socket"))
    tcp = config.listen.tcp
    if not tcp or is_loopback(tcp) or config.auth.allow_insecure_tcp:
        return
    if table is not None and table.grants:
        if not config.tls.cert_file:
            log.warning("listen.tcp %s is not loopback and has no TLS: bearer tokens travel in "
                        "clear text; set tls.cert_file and tls.key_file", tcp,
                        extra={"event": "auth_cleartext_tokens"})
        return
    if config.tls.client_ca_file:
        return
    why = ("auth.tokens_file defines no token" if table is not None else
           "there is no auth.tokens_file")
    raise ConfigError(
        f"listen.tcp = {tcp!r} (from {config.source_of('listen.tcp')}) is not a loopback address "
        f"and nothing authenticates its clients ({why}, and tls.client_ca_file is not set): "
        "set auth.tokens_file (bearer tokens) or tls.cert_file, tls.key_file and "
        "tls.client_ca_file (mutual TLS), bind listen.tcp to 127.0.0.1, or set "
        "auth.allow_insecure_tcp = true if a firewall or a container network guards the port",
        key="listen.tcp", source=config.source_of("listen.tcp"))


def server_credentials(config: Config) -> Optional[grpc.ServerCredentials]:
    """TLS credentials for listen.tcp, or None for plain TCP. ConfigError on unreadable files."""
    tls = config.tls
    if not tls.cert_file:
        return None

    def read(key: str, path: str) -> bytes:
        try:
            with open(path, "rb") as fh:
                return fh.read()
        except OSError as e:
            raise ConfigError(f"{key} = {path!r}: cannot read it: {e.strerror or e}",
                              key=key, source=config.source_of(key)) from None

    chain = read("tls.cert_file", tls.cert_file)
    key = read("tls.key_file", tls.key_file)
    ca = read("tls.client_ca_file", tls.client_ca_file) if tls.client_ca_file else None
    return grpc.ssl_server_credentials([(key, chain)], root_certificates=ca,
                                       require_client_auth=ca is not None)


# ------------------------------------------------------------------ per call
def bearer_token(metadata: Optional[Sequence[Any]]) -> Optional[str]:
    """The token of an `authorization: Bearer <token>` entry; None when there is none."""
    for item in metadata or ():
        k, v = item[0], item[1]
        if k != "authorization":
            continue
        if isinstance(v, bytes):
            v = v.decode("latin-1")
        scheme, _, token = v.partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise errors.Unauthenticated(
                "the authorization metadata must be 'Bearer <token>'")
        return token.strip()
    return None


class AuthPolicy:
    """Decides who a caller is. `table` may be swapped at any time (reload)."""

    def __init__(self, table: TokenTable, *, mutual_tls: bool,
                 require_token_on_socket: bool = False) -> None:
        self.table = table
        self.mutual_tls = mutual_tls
        self.require_token_on_socket = require_token_on_socket
        self.denials = RepeatLog(log, "auth_denied")

    def identify(self, peer: str, tls_subject: Optional[str], token: Optional[str]) -> Caller:
        if token is not None:
            grant = self.table.find(token)
            if grant is None:
                raise errors.Unauthenticated(
                    "the bearer token is not valid; ask the operator for a token listed in "
                    "the daemon's auth.tokens_file")
            return Caller(grant.name, grant.models, grant.admin, identity.for_token(grant.name))
        if peer.startswith("unix:"):
            if not self.require_token_on_socket:
                return SOCKET_CALLER
        elif not self.table.grants and (tls_subject or not self.mutual_tls):
            if tls_subject:
                return Caller(f"client certificate {tls_subject}", None, True,
                              Identity(identity.MTLS_PREFIX + tls_subject))
            return Caller("tcp (no authentication configured)", None, True, identity.TCP)
        raise errors.Unauthenticated(
            "this listener needs a bearer token: send the metadata 'authorization: Bearer "
            "<token>' (kvkeeper CLI: --token-file or $KVKEEPER_TOKEN; client: token=)")

    def identify_context(self, context: Any) -> Caller:
        return self.identify(context.peer() or "", identity.tls_subject(context),
                             bearer_token(context.invocation_metadata()))

    def covers(self, context: Any, model_id: str) -> bool:
        """Whether the caller may use `model_id` (what check_namespace
        enforces), without refusing or logging: for answers that list many."""
        return self.identify_context(context).allows_model(model_id)

    def check_namespace(self, context: Any, model_id: str) -> None:
        """The RegisterSession hook: PermissionDenied unless the caller may use `model_id`."""
        caller = self.identify_context(context)
        if not caller.allows_model(model_id):
            self.denials.log("auth: %s may not register model %s", caller.name, clip(model_id),
                             caller=caller.name, peer=context.peer())
            raise errors.PermissionDenied(
                f"the token {caller.name!r} does not cover model {clip(model_id)}; it covers "
                f"{', '.join(sorted(caller.models or ()))}")


class AuthInterceptor(grpc.aio.ServerInterceptor):
    def __init__(self, policy: AuthPolicy) -> None:
        self.policy = policy
        self.refusals = RepeatLog(log, "auth_refused")
        self._wrapped: dict[str, tuple[Any, Any]] = {}

    async def intercept_service(self, continuation: Callable[[Any], Awaitable[Any]],
                                details: Any) -> Any:
        handler = await continuation(details)
        method = details.method
        if handler is None or method.split("/")[1] in OPEN_SERVICES:
            return handler
        cached = self._wrapped.get(method)
        if cached is None or cached[0] is not handler:
            cached = (handler, self._wrap(handler, method))
            self._wrapped[method] = cached
        return cached[1]

    async def _check(self, context: Any, method: str, admin: bool) -> bool:
        """True when the caller may go on; otherwise the refusal is set on the call
        (without context.abort(): see api.status.set_status)."""
        try:
            caller = self.policy.identify_context(context)
            if admin and not caller.admin:
                raise errors.PermissionDenied(
                    f"{method} needs a token marked admin = true in auth.tokens_file; "
                    f"{caller.name!r} is not")
        except (errors.Unauthenticated, errors.PermissionDenied) as exc:
            self.refusals.log("auth: refused %s from %s: %s", method, context.peer(), exc,
                              method=method, peer=context.peer())
            set_status(context, *status_for(exc))
            return False
        # The handler runs in this same task: it reads who the caller is from here.
        identity.CURRENT.set(caller.identity)
        return True

    def _wrap(self, handler: Any, method: str) -> Any:
        admin = method.split("/")[1] == ADMIN_SERVICE
        check = self._check
        inner_uu, inner_us = handler.unary_unary, handler.unary_stream
        inner_su, inner_ss = handler.stream_unary, handler.stream_stream
        kw = dict(request_deserializer=handler.request_deserializer,
                  response_serializer=handler.response_serializer)

        async def unary(request: Any, context: Any) -> Any:
            if not await check(context, method, admin):
                return None
            return await (inner_uu or inner_su)(request, context)

        async def streaming(request: Any, context: Any) -> Any:
            if not await check(context, method, admin):
                return
            out = (inner_us or inner_ss)(request, context)
            if hasattr(out, "__aiter__"):
                async for item in out:
                    yield item
            else:  # a handler that writes with context.write()
                await out

        if inner_uu is not None:
            return grpc.unary_unary_rpc_method_handler(unary, **kw)
        if inner_su is not None:
            return grpc.stream_unary_rpc_method_handler(unary, **kw)
        if inner_us is not None:
            return grpc.unary_stream_rpc_method_handler(streaming, **kw)
        return grpc.stream_stream_rpc_method_handler(streaming, **kw)
