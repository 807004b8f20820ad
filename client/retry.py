"""Retry with exponential backoff and jitter, for calls that did not reach the daemon.

Only UNAVAILABLE is retried: the daemon answers it while shutting down (and a
failed call never changes its state), and the channel answers it while it
cannot connect, e.g. while a restarted daemon comes up. DEADLINE_EXCEEDED is
never retried because the call may have been applied. Which calls may be
retried at all (idempotent ones) is the caller's choice: pass max_retries=0
otherwise. Jitter spreads out the many vLLM workers that lose the same daemon
at the same moment.
"""
from __future__ import annotations

import asyncio
import random
import time
from typing import Awaitable, Callable, Collection, TypeVar

import grpc

__all__ = ["RETRYABLE", "backoff_delay", "call_with_retry", "call_with_retry_sync"]

T = TypeVar("T")
RETRYABLE: frozenset = frozenset({grpc.StatusCode.UNAVAILABLE})
BASE_DELAY = 0.1
MAX_DELAY = 2.0


def backoff_delay(attempt: int, base: float = BASE_DELAY, cap: float = MAX_DELAY,
                  rand: Callable[[], float] = random.random) -> float:
    """Seconds to wait before retry number `attempt` (0-based): base*2^attempt,
    capped, times a random factor in [0.5, 1)."""
    return min(cap, base * (2 ** attempt)) * (0.5 + 0.5 * rand())


def _retryable(err: BaseException, codes: Collection[grpc.StatusCode]) -> bool:
    return isinstance(err, grpc.RpcError) and callable(getattr(err, "code", None)) \
        and err.code() in codes


async def call_with_retry(fn: Callable[[], Awaitable[T]], *, max_retries: int,
                          codes: Collection[grpc.StatusCode] = RETRYABLE,
                          base: float = BASE_DELAY, cap: float = MAX_DELAY,
                          sleep: Callable[[float], Awaitable[object]] = asyncio.sleep,
                          rand: Callable[[], float] = random.random) -> T:
    """Await fn() (a fresh call each time), retrying up to max_retries times on
    grpc errors whose code is in `codes`; the last error propagates unchanged."""
    attempt = 0
    while True:
        try:
            return await fn()
        except grpc.RpcError as err:
            if attempt >= max_retries or not _retryable(err, codes):
                raise
        await sleep(backoff_delay(attempt, base, cap, rand))
        attempt += 1


def call_with_retry_sync(fn: Callable[[], T], *, max_retries: int,
                         codes: Collection[grpc.StatusCode] = RETRYABLE,
                         base: float = BASE_DELAY, cap: float = MAX_DELAY,
                         sleep: Callable[[float], object] = time.sleep,
                         rand: Callable[[], float] = random.random) -> T:
    """Blocking twin of call_with_retry, for code that calls grpc stubs directly."""
    attempt = 0
    while True:
        try:
            return fn()
        except grpc.RpcError as err:
            if attempt >= max_retries or not _retryable(err, codes):
                raise
        sleep(backoff_delay(attempt, base, cap, rand))
        attempt += 1
