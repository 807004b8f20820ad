"""The one place where daemon errors become gRPC status codes.

Client faults keep their message, which already says what to do. Anything
else is the daemon's fault: logged with its traceback, answered INTERNAL.
"""
from __future__ import annotations

import logging
from typing import Any

import grpc

from .. import errors
from ..quoting import cap

log = logging.getLogger("kvkeeper.api")

# Most specific first: InvalidTransition is a FailedPrecondition.
_CODES: tuple[tuple[type[BaseException], grpc.StatusCode], ...] = (
    (errors.InvalidArgument, grpc.StatusCode.INVALID_ARGUMENT),
    (errors.NotFound, grpc.StatusCode.NOT_FOUND),
    (errors.FailedPrecondition, grpc.StatusCode.FAILED_PRECONDITION),
    (errors.OutOfRange, grpc.StatusCode.OUT_OF_RANGE),
    (errors.ResourceExhausted, grpc.StatusCode.RESOURCE_EXHAUSTED),
    (errors.Unauthenticated, grpc.StatusCode.UNAUTHENTICATED),
    (errors.PermissionDenied, grpc.StatusCode.PERMISSION_DENIED),
    (errors.Unavailable, grpc.StatusCode.UNAVAILABLE),
    (errors.DeadlineExceeded, grpc.StatusCode.DEADLINE_EXCEEDED),
)


def status_for(exc: BaseException) -> tuple[grpc.StatusCode, str]:
    """The code and message for `exc`. Messages quote client values through
    quoting.clip(); cap() is the last guard against an answer gRPC would refuse."""
    for cls, code in _CODES:
        if isinstance(exc, cls):
            return code, cap(str(exc))
    if isinstance(exc, errors.InvariantViolation):
        log.critical("LEDGER INVARIANT BROKEN: %s", exc, exc_info=exc)
        return grpc.StatusCode.INTERNAL, cap(f"internal error (ledger invariant): {exc}")
    log.error("unexpected error: %r", exc, exc_info=exc)
    return grpc.StatusCode.INTERNAL, f"internal error: {type(exc).__name__}; see the daemon log"


def set_status(context: Any, code: grpc.StatusCode, msg: str) -> None:
    """Put a status on the call without raising.

    Not context.abort(): the AbortError it raises stays referenced by the
    call's state, which its traceback's frames reference back (RPCState ->
    AbortError -> traceback -> handler frame -> context -> RPCState). Only the
    cyclic GC frees that, and never once it is frozen (server/ops/gcpolicy.py).
    A handler returns after this; grpc.aio then sends the status and no message.
    """
    context.set_code(code)
    context.set_details(msg)
