"""kvkeeper client library: talk to the kvkeeper daemon from a vLLM instance.

`AsyncClient` (asyncio) and `Client` (blocking, thread-safe) hold one session
for one namespace. This package never imports the daemon (kvkeeper.server),
vLLM or torch, so it installs and runs on any host that can reach the daemon.
"""
from __future__ import annotations

from .aio import AsyncClient
from .checksum import ALGOS, crc32, xxh3_64
from .errors import (ChecksumError, DeadlineExceededError, FailedPreconditionError,
                     InvalidArgumentError, KVKeeperClientError, NotFoundError, OutOfRangeError,
                     PermissionDeniedError, ResourceExhaustedError, UnauthenticatedError,
                     UnavailableError, from_rpc_error, is_session_lost)
from .leases import MatchResult
from .retry import call_with_retry, call_with_retry_sync
from .saves import SaveResult
from .sync import Client
from .url import KeeperURL, parse_url, to_grpc_target

__all__ = [
    "AsyncClient", "Client", "MatchResult", "SaveResult",
    "KVKeeperClientError", "NotFoundError", "FailedPreconditionError", "InvalidArgumentError",
    "ResourceExhaustedError", "UnavailableError", "OutOfRangeError", "DeadlineExceededError",
    "PermissionDeniedError", "UnauthenticatedError", "ChecksumError", "from_rpc_error",
    "is_session_lost",
    "ALGOS", "crc32", "xxh3_64", "call_with_retry", "call_with_retry_sync",
    "KeeperURL", "parse_url", "to_grpc_target",
]
