"""Errors split by blame.

Client faults carry a message that tells the caller what to do; the gRPC
adapter maps each class to one status code (see kvkeeper.server.api.status).
InvariantViolation is the daemon's own fault and is logged loudly.
Nothing here imports grpc: the ledger raises these without knowing about RPCs.
"""
from __future__ import annotations


class KVKeeperError(Exception):
    """Base of every error the daemon raises on purpose."""


class ClientError(KVKeeperError):
    """The request was wrong; the daemon's state is unchanged."""


class InvalidArgument(ClientError):
    """Malformed input: a key of the wrong length, a bad descriptor, a bad count."""


class NotFound(ClientError):
    """An id that the daemon never issued (session, lease, reservation)."""


class FailedPrecondition(ClientError):
    """A valid id in the wrong state: expired session, lease already released."""


class OutOfRange(ClientError):
    """Bytes written past the end of a block."""


class ResourceExhausted(ClientError):
    """Not enough free or evictable capacity; nothing was reserved."""


class Unauthenticated(ClientError):
    """No credentials where the listener needs them, or credentials nobody issued."""


class PermissionDenied(ClientError):
    """Valid credentials that do not cover this namespace or this RPC."""


class Unavailable(KVKeeperError):
    """The daemon is shutting down or a tier cannot be reached; retry later."""


class DeadlineExceeded(KVKeeperError):
    """The caller's deadline passed before the answer was ready; nothing the
    call would have granted was kept."""


class InvalidTransition(FailedPrecondition):
    """An event that the block's current state does not allow."""

    def __init__(self, block: str, state: str, event: str, hint: str = "") -> None:
        self.block, self.state, self.event = block, state, event
        msg = f"block {block}: event {event!r} is not allowed in state {state!r}"
        super().__init__(f"{msg}; {hint}" if hint else msg)


class InvariantViolation(KVKeeperError):
    """The ledger's bookkeeping is inconsistent: a bug in the daemon."""
