"""The client's session watch (client/watch.py) against a scripted fake daemon:
held beside the heartbeats, retried while the daemon is away, the cue to
register again when the daemon lost the session, let go after CloseSession,
and never retried against a daemon that has no WatchSession."""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import time
from typing import Any, Callable

import grpc
import pytest

from kvkeeper.client import AsyncClient
from kvkeeper.client.watch import RETRY_MAX_S, RETRY_MIN_S
from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

NS = {"model_id": "m", "block_tokens": 16, "block_bytes": 4096}
U, NF = grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.NOT_FOUND


class Fake(pb_grpc.KVKeeperServicer):
    """Sessions s1, s2...; WatchSession fails with script[i] on its i-th call
    (None: holds the call), or is not implemented at all."""

    def __init__(self, script: list, watch: bool = True) -> None:
        self.script = list(script)
        self.sessions: list[str] = []
        self.watch_calls: list[str] = []   # the session id of each WatchSession
        self.held: set[str] = set()        # sessions watched now
        self.log: list[str] = []           # CloseSession and watch ends, in order
        self.watch = watch

    async def RegisterSession(self, request, context):
        self.sessions.append(f"s{len(self.sessions) + 1}")
        return pb.RegisterSessionResponse(session_id=self.sessions[-1], lease_ttl_seconds=30,
                                          key_bytes=32, max_keys_per_call=64)

    async def Heartbeat(self, request, context):
        return pb.HeartbeatResponse(lease_ttl_seconds=30)

    async def CloseSession(self, request, context):
        self.log.append(f"close {request.session_id}")
        return pb.CloseSessionResponse()

    async def Match(self, request, context):
        return pb.MatchResponse(matched=0)

    async def WatchSession(self, request, context):
        sid = request.session_id
        self.watch_calls.append(sid)
        if not self.watch:   # as a daemon from before WatchSession answers
            await context.abort(grpc.StatusCode.UNIMPLEMENTED, "Method not found!")
        step = self.script.pop(0) if self.script else None
        if step is not None:
            code, details = step
            await context.abort(code, details.format(sid=sid))
        self.held.add(sid)
        context.add_done_callback(lambda _: (self.held.discard(sid),
                                             self.log.append(f"watch end {sid}")))
        yield pb.SessionEvent()
        await asyncio.Event().wait()   # until the client goes


@pytest.fixture
async def serve():
    started: list[Any] = []
    tmp = tempfile.mkdtemp(prefix="kvkw-", dir="/tmp")

    async def start(fake: Fake) -> str:
        server = grpc.aio.server()
        pb_grpc.add_KVKeeperServicer_to_server(fake, server)
        path = os.path.join(tmp, f"k{len(started)}.sock")
        server.add_insecure_port(f"unix:{path}")
        await server.start()
        started.append(server)
        return f"unix://{path}"

    yield start
    for server in started:
        await server.stop(0)
    shutil.rmtree(tmp, ignore_errors=True)


async def until(cond: Callable[[], bool], what: str, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


async def test_the_watch_is_held_and_let_go_only_after_close_session(serve) -> None:
    fake = Fake([])
    c = await AsyncClient.connect(await serve(fake), NS)
    await until(lambda: fake.held == {"s1"}, "the client never watched")
    await c.close()
    # CloseSession first: a watch ended before it would end the session as disconnected.
    await until(lambda: len(fake.log) == 2, "the watch was not let go")
    assert fake.log == ["close s1", "watch end s1"]


async def test_the_watch_is_opened_again_while_the_daemon_is_away(serve) -> None:
    fake = Fake([(U, "down"), (U, "down"), (U, "down")])
    c = await AsyncClient.connect(await serve(fake), NS)
    try:
        await until(lambda: fake.held == {"s1"}, "the client did not watch once back",
                    timeout=10 * RETRY_MAX_S)
        assert fake.watch_calls == ["s1"] * 4 and fake.sessions == ["s1"]
    finally:
        await c.close()


async def test_a_session_the_daemon_lost_is_registered_again_and_watched(serve) -> None:
    fake = Fake([(NF, "unknown session {sid}: register")])
    c = await AsyncClient.connect(await serve(fake), NS)
    try:
        await until(lambda: fake.held == {"s2"}, "the new session was not watched")
        assert fake.sessions == ["s1", "s2"] and c.session_id == "s2"
        assert fake.watch_calls == ["s1", "s2"]
    finally:
        await c.close()


async def test_a_daemon_without_watch_session_is_left_to_heartbeats(serve) -> None:
    fake = Fake([], watch=False)
    c = await AsyncClient.connect(await serve(fake), NS)
    try:
        assert (await c.match([b"k" * 32])).matched == 0
        # Long enough for several retries, were there any.
        await asyncio.sleep(3 * (RETRY_MIN_S + RETRY_MAX_S))
        assert fake.watch_calls == ["s1"] and fake.sessions == ["s1"]
        assert (await c.match([b"k" * 32])).matched == 0
    finally:
        await c.close()
