"""The one wrapper around every handler of both services (KVKeeper, KVKeeperAdmin).

For each call: refuse while the daemon drains, turn an undecodable request (or
stream chunk) into INVALID_ARGUMENT, map every error to its status through
status.py, log what a client can cause at a bounded rate, and time the call
into kvkeeper_rpc_duration_seconds / kvkeeper_rpc_errors_total.

A servicer using it has `serving` (bool), `calls` (drain.Calls: every call is
counted in flight, refused ones too, since their answers must reach the client
before a stop drops the connection) and `metrics` (Metrics or None).
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, AsyncIterator, Callable, Optional

import grpc

from ..errors import Unavailable
from ..ledger.sessions import ForeignSession
from ..ops.ratelog import RepeatLog
from .decoding import Malformed, MalformedRequest
from .status import set_status, status_for

log = logging.getLogger("kvkeeper.api")

_malformed = RepeatLog(log, "malformed_request")
_foreign = RepeatLog(logging.getLogger("kvkeeper.auth"), "auth_denied")

_DRAINING = "the daemon is shutting down; retry against the restarted daemon"


async def _checked(requests: AsyncIterator[Any]) -> AsyncIterator[Any]:
    """A request stream whose undecodable chunks raise MalformedRequest."""
    async for item in requests:
        if type(item) is Malformed:
            raise item.error
        yield item


def _admit(self: Any, request: Any) -> Any:
    if not self.serving:
        raise Unavailable(_DRAINING)
    if type(request) is Malformed:
        raise request.error
    if hasattr(request, "__aiter__"):
        return _checked(request)
    return request


def _note(method: str, exc: BaseException, context: Any) -> None:
    """The log line for a client fault worth an operator's eye, rate-limited."""
    if isinstance(exc, MalformedRequest):
        _malformed.log("malformed request to %s from %s: %s", method, context.peer(), exc,
                       method=method)
    elif isinstance(exc, ForeignSession):
        # Never the id: it is the other identity's secret.
        _foreign.log("auth: %s named a session of another identity (answered as unknown)",
                     method, method=method, peer=context.peer())


def _answer(method: str, exc: BaseException, context: Any) -> tuple[grpc.StatusCode, str]:
    _note(method, exc, context)
    return status_for(exc)


def _observe(self: Any, method: str, t0: Optional[float], code: Any) -> None:
    """t0 None: count the code only (a call held open has no time to answer)."""
    if self.metrics is not None:
        self.metrics.observe_rpc(method, None if t0 is None else time.perf_counter() - t0, code)


def rpc(fn: Callable[..., Any]) -> Callable[..., Any]:
    """Unary and client-streaming handlers."""
    method = fn.__name__

    @functools.wraps(fn)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        t0 = time.perf_counter()
        code: Any = None
        calls = self.calls
        calls.active += 1
        try:
            return await fn(self, _admit(self, request), context)
        except Exception as exc:  # noqa: BLE001 - every error gets a status
            code, msg = _answer(method, exc, context)
            set_status(context, code, msg)
            return None
        finally:
            calls.leave()
            _observe(self, method, t0, code)

    return handler


def rpc_stream(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
    """Server-streaming handlers: the same contract, as an async generator."""
    return _streaming(fn, timed=True)


def rpc_held(fn: Callable[..., AsyncIterator[Any]]) -> Callable[..., Any]:
    """A server-streaming handler whose call lasts as long as its client
    (WatchSession): as rpc_stream, but its errors alone are counted, since
    its duration says how long a client lived, not how fast the daemon answered."""
    return _streaming(fn, timed=False)


def _streaming(fn: Callable[..., AsyncIterator[Any]], *, timed: bool) -> Callable[..., Any]:
    method = fn.__name__

    @functools.wraps(fn)
    async def handler(self: Any, request: Any, context: grpc.aio.ServicerContext) -> Any:
        t0 = time.perf_counter() if timed else None
        code: Any = None
        calls = self.calls
        calls.active += 1
        try:
            async for item in fn(self, _admit(self, request), context):
                yield item
        except Exception as exc:  # noqa: BLE001
            code, msg = _answer(method, exc, context)
            set_status(context, code, msg)
        finally:
            calls.leave()
            _observe(self, method, t0, code)

    return handler
