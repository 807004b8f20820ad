"""How the blocking Client waits for a coroutine on its event loop thread.

A call is bounded (`budget`): past it the coroutine is cancelled and the
caller gets DeadlineExceededError. Cancelling takes effect on the loop thread
while the caller goes on, so the caller also waits (up to ENDED_WAIT_S) for
the coroutine to have ended: a load or save copying in worker threads ends
only once they have (copies.in_threads), and a caller told "deadline" must
be free to reuse its buffers at once.
"""
from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Future
from typing import Any, Coroutine, Optional, TypeVar

import grpc

from .errors import DeadlineExceededError
from .retry import MAX_DELAY

__all__ = ["ENDED_WAIT_S", "budget_for", "submit", "wait_result"]

T = TypeVar("T")
# The most a cancelled call's caller waits for its coroutine to end (copies of
# a few GB at memory speed take seconds; a stuck one is not waited for longer).
ENDED_WAIT_S = 30.0


def budget_for(timeout: float, max_retries: int, rpcs: int) -> float:
    """Worst case of `rpcs` calls each using its deadline on every try, plus backoff."""
    per_rpc = timeout * (max_retries + 1) + MAX_DELAY * max_retries
    return rpcs * per_rpc + 5.0


class Submitted:
    """A coroutine running on a loop thread, and the event set once it ended."""

    def __init__(self, coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop) -> None:
        self.ended = threading.Event()
        self.future: Future[Any] = asyncio.run_coroutine_threadsafe(self._run(coro), loop)

    async def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        try:
            return await coro
        finally:
            self.ended.set()


def submit(coro: Coroutine[Any, Any, T], loop: asyncio.AbstractEventLoop) -> Submitted:
    return Submitted(coro, loop)


def wait_result(sub: Submitted, budget: float, what: str) -> Any:
    fut = sub.future
    try:
        return fut.result(timeout=budget)
    except TimeoutError:
        if fut.done():  # the coroutine itself raised TimeoutError
            raise
        _cancel(sub)
        raise DeadlineExceededError(f"{what} did not finish within {budget:.1f} s",
                                    grpc.StatusCode.DEADLINE_EXCEEDED) from None
    except BaseException:
        _cancel(sub)  # e.g. KeyboardInterrupt in the caller: stop the work too
        raise


def _cancel(sub: Submitted, wait_s: Optional[float] = ENDED_WAIT_S) -> None:
    sub.future.cancel()
    sub.ended.wait(wait_s)
