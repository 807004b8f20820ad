"""AsyncMatchLane (client/match_lane.py) against scripted asyncio servers: its pool
of connections, where it gives way to gRPC (None), and how a call that does
not end with a whole answer never leaves its connection to another call."""
from __future__ import annotations

import asyncio
import os
import socket
from typing import Any, Awaitable, Callable, List

import grpc
import pytest

from kvkeeper.client.errors import is_session_lost
from kvkeeper.client.match_lane import (LEN, MAX_IDLE, AsyncMatchLane, LaneError, answer_frame,
                                        lane_for)

Script = Callable[[asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]]


async def read_request(r: asyncio.StreamReader) -> bytes:
    n = LEN.unpack(await r.readexactly(LEN.size))[0]
    return await r.readexactly(n)


async def echo_server(path: str, conns: List[Any]) -> asyncio.AbstractServer:
    """Answers each request with OK and the request's bytes; conns[0]
    counts the connections it accepted, and their writers follow it."""
    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns[0] += 1
        conns.append(w)
        try:
            while True:
                req = await read_request(r)
                if req == b"slow":
                    await asyncio.sleep(0.2)
                w.write(answer_frame(grpc.StatusCode.OK, req))
                await w.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            pass
        finally:
            w.close()
    return await asyncio.start_unix_server(serve, path)


async def test_no_socket_gives_way_to_grpc_and_backs_off(path: str, clock: Any) -> None:
    lane = AsyncMatchLane(path, clock=clock)
    assert await lane.call(b"req", 1.0) is None
    conns = [0]
    srv = await echo_server(path, conns)
    try:
        assert await lane.call(b"req", 1.0) is None   # within the back-off: not even tried
        clock.now += 1.01
        assert await lane.call(b"req", 1.0) == b"req" and lane.calls == 1
    finally:
        lane.close()
        srv.close()


async def test_calls_reuse_a_connection_and_concurrent_ones_get_their_own(path: str) -> None:
    conns = [0]
    srv = await echo_server(path, conns)
    lane = AsyncMatchLane(path)
    try:
        for i in range(5):
            assert await lane.call(b"n%d" % i, 1.0) == b"n%d" % i
        assert conns[0] == 1
        # Three at once: each answer is its own call's, on three connections.
        got = await asyncio.gather(*(lane.call(b"c%d" % i, 2.0) for i in range(3)))
        assert got == [b"c0", b"c1", b"c2"] and conns[0] == 3 and lane.calls == 8
    finally:
        lane.close()
        srv.close()


async def test_a_status_is_the_calls_error_and_keeps_the_connection(path: str) -> None:
    details = "unknown session 'x'; RegisterSession first"
    conns = [0]

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns[0] += 1
        assert await read_request(r) == b"abc"
        w.write(answer_frame(grpc.StatusCode.NOT_FOUND, details.encode()))
        assert await read_request(r) == b"again"
        w.write(answer_frame(grpc.StatusCode.OK, b""))
        await w.drain()

    srv = await asyncio.start_unix_server(serve, path)
    lane = AsyncMatchLane(path)
    try:
        with pytest.raises(LaneError) as e:
            await lane.call(b"abc", 2.0)
        assert e.value.code() == grpc.StatusCode.NOT_FOUND and is_session_lost(e.value)
        assert await lane.call(b"again", 2.0) == b"" and lane.calls == 1 and conns[0] == 1
    finally:
        lane.close()
        srv.close()


@pytest.mark.parametrize("reply, code", [
    (b"", grpc.StatusCode.UNAVAILABLE),                          # closed after the request
    (LEN.pack(10) + b"\x00abc", grpc.StatusCode.UNAVAILABLE),   # closed mid-answer
    (None, grpc.StatusCode.DEADLINE_EXCEEDED),                  # answers too late
])
async def test_an_answer_that_never_comes_whole_fails_the_call(path: str, reply: Any,
                                                               code: grpc.StatusCode) -> None:
    conns = [0]

    async def serve(r: asyncio.StreamReader, w: asyncio.StreamWriter) -> None:
        conns[0] += 1
        req = await read_request(r)
        if conns[0] == 1 and reply is not None:
            w.write(reply)
            w.close()
            return
        if conns[0] == 1:
            await asyncio.sleep(0.3)   # the late answer: it must reach no other call
        w.write(answer_frame(grpc.StatusCode.OK, req))
        try:
            assert await read_request(r) == b"third"
            w.write(answer_frame(grpc.StatusCode.OK, b"late-conn"))
        except asyncio.IncompleteReadError:
            pass

    srv = await asyncio.start_unix_server(serve, path)
    lane = AsyncMatchLane(path)
    try:
        with pytest.raises(LaneError) as e:
            await lane.call(b"first", 0.1)
        assert e.value.code() == code
        # A new connection, whose answer is its own call's.
        assert await lane.call(b"second", 1.0) == b"second" and conns[0] == 2
    finally:
        lane.close()
        srv.close()


async def test_a_cancelled_call_leaves_no_connection_behind(path: str) -> None:
    conns = [0]
    srv = await echo_server(path, conns)
    lane = AsyncMatchLane(path)
    try:
        t = asyncio.ensure_future(lane.call(b"slow", 2.0))
        await asyncio.sleep(0.05)
        t.cancel()
        with pytest.raises(asyncio.CancelledError):
            await t
        await asyncio.sleep(0.3)   # the slow answer has come, to a closed connection
        assert await lane.call(b"next", 1.0) == b"next" and conns[0] == 2
    finally:
        lane.close()
        srv.close()


async def test_an_idle_connection_the_daemon_closed_is_not_used(path: str) -> None:
    """A daemon restart closes idle connections: the next call opens a new
    one instead of failing on the dead one."""
    conns = [0]
    srv = await echo_server(path, conns)
    lane = AsyncMatchLane(path)
    try:
        assert await lane.call(b"a", 1.0) == b"a"
        srv.close()
        conns[1].close()   # the connection ends with the daemon
        if os.path.exists(path):
            os.unlink(path)
        await asyncio.sleep(0.05)   # the daemon is gone; the loop saw the EOF
        srv = await echo_server(path, conns)
        assert await lane.call(b"b", 1.0) == b"b" and conns[0] == 2
    finally:
        lane.close()
        srv.close()


def test_the_async_lane_is_made_where_the_blocking_one_would_be() -> None:
    lane = lane_for("unix:/run/kvk.sock", None, None, AsyncMatchLane)
    assert isinstance(lane, AsyncMatchLane) and lane.path == "/run/kvk.sock.match"
    assert lane_for("unix:/run/kvk.sock", None, "a-token", AsyncMatchLane) is None


async def test_a_full_listen_queue_gives_way_to_grpc_without_a_back_off(path: str) -> None:
    # A listener that never accepts: once its queue is full, a unix connect
    # fails with EAGAIN, which asyncio hands back as an unconnected socket.
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(0)
    held = []
    try:
        for _ in range(4):   # fill the queue
            c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            c.setblocking(False)
            try:
                c.connect(path)
            except BlockingIOError:
                c.close()
                break
            held.append(c)
        lane = AsyncMatchLane(path)
        try:
            # Not sent, so not the call's error: it goes over gRPC.
            assert await lane.call(b"req", 1.0) is None
            assert lane.calls == 0
        finally:
            lane.close()
        # The queue drains (here: a new listener): the next call uses the lane.
        for c in held:
            c.close()
        srv.close()
        os.unlink(path)
        conns = [0]
        echo = await echo_server(path, conns)
        try:
            lane = AsyncMatchLane(path)
            assert await lane.call(b"req", 1.0) == b"req"
            lane.close()
        finally:
            echo.close()
    finally:
        for c in held:
            c.close()
        srv.close()


async def test_a_burst_leaves_at_most_max_idle_connections(path: str) -> None:
    conns = [0]
    srv = await echo_server(path, conns)
    lane = AsyncMatchLane(path)
    try:
        n = MAX_IDLE + 8
        got = await asyncio.gather(*(lane.call(b"slow", 2.0) for _ in range(n)))
        assert got == [b"slow"] * n and conns[0] == n
        await asyncio.sleep(0.05)   # the server sees the surplus close
        open_now = sum(1 for w in conns[1:] if not w.is_closing())
        assert open_now == MAX_IDLE
        for _ in range(3):   # and the kept ones are used
            assert await lane.call(b"x", 1.0) == b"x"
        assert conns[0] == n
    finally:
        lane.close()
        srv.close()
