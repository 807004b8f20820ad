"""Draining calls at stop: in flight first, then a linger with the connections
open, all within the grace period (server/api/drain.py, Daemon.stop)."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
import pytest
from test_servicer_match_blocks import data, saved

from kvkeeper.server.api.drain import Calls
from kvkeeper.v1 import kvkeeper_pb2 as pb


async def test_settle_without_any_call_returns_at_once() -> None:
    calls = Calls()
    # A linger counts from the last call's end: with none, there is nothing to wait for.
    await asyncio.wait_for(calls.settle(time.monotonic() + 60, linger=30), timeout=10)


async def test_settle_waits_for_calls_in_flight_then_lingers() -> None:
    calls = Calls()
    calls.active += 1
    settling = asyncio.ensure_future(calls.settle(time.monotonic() + 60, linger=0.2))
    await asyncio.sleep(0.1)
    assert not settling.done(), "a call in flight holds the drain"
    calls.leave()
    ended = time.monotonic()
    await asyncio.wait_for(settling, timeout=10)
    assert time.monotonic() - ended >= 0.2 - 0.02
    assert calls.active == 0


async def test_settle_ends_at_the_deadline_whatever_is_in_flight() -> None:
    calls = Calls()
    calls.active += 1
    calls.last_end = time.monotonic()
    t0 = time.monotonic()
    await asyncio.wait_for(calls.settle(t0 + 0.1, linger=600), timeout=10)
    assert time.monotonic() - t0 >= 0.1 - 0.02
    assert calls.active == 1


async def test_every_call_is_counted_refused_ones_too(daemon: Any, stub: Any) -> None:
    calls = daemon.servicer.calls
    sid, ks = await saved(stub, 2)
    before = calls.last_end
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=ks, lease=True))
    chunks = [c async for c in stub.LoadStream(pb.LoadRequest(session_id=sid, lease_id=m.lease_id))]
    assert len(chunks) >= 2
    assert calls.active == 0 and calls.last_end > before
    daemon.servicer.serving = False
    before = calls.last_end
    with pytest.raises(grpc.aio.AioRpcError):
        await stub.Match(pb.MatchRequest(session_id=sid, keys=ks))
    assert calls.active == 0 and calls.last_end > before


async def test_stop_drains_a_slow_stream_and_keeps_the_connection_while_it_lingers(
        daemon: Any, stub: Any) -> None:
    daemon.servicer.stream_chunk_bytes = 4096
    sid, ks = await saved(stub, 3)
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=ks, lease=True))
    stream = stub.LoadStream(pb.LoadRequest(session_id=sid, lease_id=m.lease_id))
    got = [await stream.read()]
    stopping = asyncio.ensure_future(daemon.stop(60.0, linger=2.0))
    await asyncio.sleep(0.2)
    while (chunk := await stream.read()) is not grpc.aio.EOF:
        got.append(chunk)
        await asyncio.sleep(0.005)
    parts: dict = {}
    for c in got:
        parts.setdefault(c.index, []).append((c.offset, c.data))
    assert {i: b"".join(d for _, d in sorted(p)) for i, p in parts.items()} == {
        i: data(i) for i in range(3)}
    assert not stopping.done(), "stop waits for the stream, then lingers"
    # The connection is still open: the daemon itself refuses the call, saying why.
    with pytest.raises(grpc.aio.AioRpcError) as refused:
        await stub.Match(pb.MatchRequest(session_id=sid, keys=ks[:1]))
    assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
    assert "shutting down" in (refused.value.details() or "")
    await asyncio.wait_for(stopping, timeout=30)
