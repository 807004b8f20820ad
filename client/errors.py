"""Exceptions the client raises, one class per gRPC status a caller acts on.

The daemon answers every fault with a gRPC status and a message that says what
to do (see the proto's header). Callers branch on the kind of fault (skip a
save on ResourceExhaustedError, re-match on NotFoundError, ...), so the client
turns grpc.aio.AioRpcError into these classes instead of leaking grpc types;
`.code` and `.details` keep the original status for logs.
"""
from __future__ import annotations

from typing import Iterable, Optional

import grpc

__all__ = [
    "KVKeeperClientError", "NotFoundError", "FailedPreconditionError", "InvalidArgumentError",
    "ResourceExhaustedError", "UnavailableError", "OutOfRangeError", "DeadlineExceededError",
    "PermissionDeniedError", "UnauthenticatedError", "ChecksumError", "from_rpc_error",
    "is_session_lost", "protocol_error",
]


class KVKeeperClientError(Exception):
    """Base class. `.code` is a grpc.StatusCode (None for client-side faults)."""

    def __init__(self, details: str, code: Optional[grpc.StatusCode] = None) -> None:
        super().__init__(details if code is None else f"{code.name}: {details}")
        self.code = code
        self.details = details


class NotFoundError(KVKeeperClientError):
    """An id the daemon never issued (or forgot): session, lease, reservation."""


class FailedPreconditionError(KVKeeperClientError):
    """A valid id in the wrong state: expired session, released lease, partial block."""


class InvalidArgumentError(KVKeeperClientError):
    """The request was malformed (key length, key count, descriptor)."""


class ResourceExhaustedError(KVKeeperClientError):
    """Not enough free or evictable capacity; nothing was reserved."""


class UnavailableError(KVKeeperClientError):
    """The daemon cannot be reached or is shutting down (after the retries)."""


class OutOfRangeError(KVKeeperClientError):
    """Bytes written beyond a block's end."""


class DeadlineExceededError(KVKeeperClientError):
    """The call's deadline passed; the daemon may or may not have applied it."""


class PermissionDeniedError(KVKeeperClientError):
    """The token does not allow it: a model it does not cover (RegisterSession;
    a reload may take one away), or an admin call without an admin token."""


class UnauthenticatedError(KVKeeperClientError):
    """No valid credentials: a token the daemon does not know (never issued, or
    removed from its tokens file), or none where the listener needs one."""


class ChecksumError(KVKeeperClientError):
    """Loaded blocks whose bytes do not match the checksum given at commit.

    The buffers are filled anyway; `.bad_indices` are positions in the lease.
    A caller typically treats them as misses and releases with discard=True.
    """

    def __init__(self, bad_indices: Iterable[int]) -> None:
        self.bad_indices = sorted(bad_indices)
        super().__init__(f"checksum mismatch in block(s) {self.bad_indices} of the lease",
                         grpc.StatusCode.DATA_LOSS)


_BY_CODE = {
    grpc.StatusCode.NOT_FOUND: NotFoundError,
    grpc.StatusCode.FAILED_PRECONDITION: FailedPreconditionError,
    grpc.StatusCode.INVALID_ARGUMENT: InvalidArgumentError,
    grpc.StatusCode.RESOURCE_EXHAUSTED: ResourceExhaustedError,
    grpc.StatusCode.UNAVAILABLE: UnavailableError,
    grpc.StatusCode.OUT_OF_RANGE: OutOfRangeError,
    grpc.StatusCode.DEADLINE_EXCEEDED: DeadlineExceededError,
    grpc.StatusCode.PERMISSION_DENIED: PermissionDeniedError,
    grpc.StatusCode.UNAUTHENTICATED: UnauthenticatedError,
}


def _code_details(err: grpc.RpcError) -> tuple[grpc.StatusCode, str]:
    code = err.code() if hasattr(err, "code") else grpc.StatusCode.UNKNOWN
    details = err.details() if hasattr(err, "details") else str(err)
    return code or grpc.StatusCode.UNKNOWN, details or ""


def from_rpc_error(err: grpc.RpcError, rpc: str = "") -> KVKeeperClientError:
    """The client exception for a failed call (grpc.aio.AioRpcError or a sync RpcError).

    `rpc` (e.g. "Match") is prefixed to the details so logs say which call failed.
    """
    code, details = _code_details(err)
    cls = _BY_CODE.get(code, KVKeeperClientError)
    exc = cls(f"{rpc}: {details}" if rpc else details, code)
    exc.__cause__ = err
    return exc


def is_session_lost(err: BaseException) -> bool:
    """Whether the daemon no longer knows this session (restarted, or it expired).

    The proto fixes the wording: NOT_FOUND "unknown session ..." or
    FAILED_PRECONDITION "session ... expired". Either way registering again is
    the cure. UNAUTHENTICATED counts too: the daemon answers it to every call
    with a token removed from its tokens file, and that reload ended the
    token's sessions (server/security/revocation.py), so registering again is
    the only way back; it is refused until the token is restored, and the
    session backs off meanwhile (refusal.py).
    """
    if isinstance(err, KVKeeperClientError):
        code, details = err.code, err.details
    elif isinstance(err, grpc.RpcError):
        code, details = _code_details(err)
    else:
        return False
    details = (details or "").lower()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return True
    if code == grpc.StatusCode.NOT_FOUND:
        return "unknown session" in details
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        return "session" in details and "expired" in details
    return False


def protocol_error(what: str) -> KVKeeperClientError:
    """The daemon answered something the protocol does not allow (the
    daemon's fault, or a version mismatch): INTERNAL, never retried."""
    return KVKeeperClientError(f"unexpected answer from the daemon: {what}",
                               grpc.StatusCode.INTERNAL)
