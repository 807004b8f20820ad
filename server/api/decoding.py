"""Requests that do not decode are the caller's fault, answered by our wrapper.

grpc calls a method's request deserializer before any handler code runs, and
answers its exception itself: UNKNOWN on unary methods, INTERNAL on streams,
which reads as a daemon fault and would fire the operator's INTERNAL alert. So
every handler is registered with a deserializer that never raises: bytes that
do not parse become a Malformed value, which the one handler wrapper
(handler.py) turns into INVALID_ARGUMENT naming the method, counted and logged
like any other client error.
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, Optional

import grpc

from ..errors import InvalidArgument
from ..quoting import clip


class MalformedRequest(InvalidArgument):
    """A request (or a chunk of a request stream) that is not the method's message."""


class Malformed:
    """What the guarded deserializer returns for bytes that do not parse."""

    __slots__ = ("error",)

    def __init__(self, error: MalformedRequest) -> None:
        self.error = error


def _message_name(deserialize: Callable[[bytes], Any]) -> str:
    """The request message a generated deserializer (Message.FromString) parses."""
    cls = getattr(deserialize, "__self__", None)
    descriptor = getattr(cls, "DESCRIPTOR", None)
    return descriptor.full_name if descriptor is not None else "the method's request message"


def guard(method: str, message: str,
          deserialize: Callable[[bytes], Any]) -> Callable[[bytes], Any]:
    """`deserialize` that answers Malformed instead of raising (the match lane's too)."""
    def safe(data: bytes) -> Any:
        try:
            return deserialize(data)
        except Exception as exc:  # noqa: BLE001 - any parse failure is the caller's
            return Malformed(MalformedRequest(
                f"malformed {method} request: {type(exc).__name__}: {clip(str(exc), 120)} "
                f"({len(data)} bytes); send a serialized {message} (see proto/kvkeeper/v1)"))
    return safe


class _Registration:
    """Stands in for the server while a generated add_*Servicer_to_server runs:
    takes its method handlers, puts in the given codecs, guards their
    deserializers, registers those."""

    def __init__(self, server: Any, codecs: Mapping[str, Mapping[str, Any]]) -> None:
        self.server = server
        self.codecs = codecs

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        # The generated code registers the same handlers twice (generic, then
        # registered); only the registered call carries them by name.
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        short = service.rsplit(".", 1)[-1]
        # Named from the generated handlers, before hand-written codecs replace them.
        messages = {name: _message_name(h.request_deserializer) for name, h in handlers.items()}
        handlers = {name: h._replace(**self.codecs.get(name, {})) for name, h in handlers.items()}
        guarded = {name: h._replace(request_deserializer=guard(
                       f"{short}/{name}", messages[name], h.request_deserializer))
                   for name, h in handlers.items()}
        # Generic only (see GenericOnly): found by one dict lookup per call.
        self.server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(service, guarded),))


class GenericOnly:
    """Stands in for the server while grpc's own add_*_to_server (health,
    reflection) runs: their handlers are added as generic ones only.

    grpc.aio's server keeps one pending task per registered method and waits
    on all of them for every call it accepts (asyncio.wait over ~24 futures
    here, adding and removing a callback on each): ~0.45 us of CPU per
    registered method per RPC, 11-17 us per call for this daemon's 24,
    measured paired against a bare grpc.aio server. A generic handler costs
    a dict lookup."""

    def __init__(self, server: Any) -> None:
        self.server = server

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.server.add_generic_rpc_handlers(handlers)

    def add_registered_method_handlers(self, service: str, handlers: dict[str, Any]) -> None:
        pass   # the same handlers came through add_generic_rpc_handlers


def add_guarded(add_to_server: Callable[[Any, Any], None], servicer: Any, server: Any,
                codecs: Optional[Mapping[str, Mapping[str, Any]]] = None) -> None:
    """`add_to_server(servicer, server)` (a generated function), every request
    guarded. codecs: per method name, serializers to use instead of the
    generated ones (e.g. {"LoadStream": {"response_serializer": f}})."""
    add_to_server(servicer, _Registration(server, codecs or {}))
