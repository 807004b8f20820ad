"""An error answer to a caller that has already gone (its deadline passed, it
cancelled) ends the call as cancelled instead of escaping to grpc, which logs
it at ERROR with a traceback. Found by tests/e2e/test_fuzz_stubs.py (short
client deadlines; a race inside grpc, so the wire cannot show it on demand)."""
from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest

from kvkeeper.server.api.status import abort


class Context:
    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    async def abort(self, code: Any, message: str) -> None:
        raise self.exc


async def test_a_status_that_cannot_be_sent_ends_the_call_as_cancelled() -> None:
    # grpc raises its (private) ExecuteBatchError from core here; any non-abort error stands for it.
    with pytest.raises(asyncio.CancelledError):
        await abort(Context(RuntimeError('Failed "execute_batch"')), grpc.StatusCode.NOT_FOUND, "x")


async def test_a_sent_status_still_raises_grpcs_abort_error() -> None:
    sent = grpc.aio.AbortError("Locally aborted.")
    with pytest.raises(grpc.aio.AbortError) as info:
        await abort(Context(sent), grpc.StatusCode.NOT_FOUND, "x")
    assert info.value is sent
