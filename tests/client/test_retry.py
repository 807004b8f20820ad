"""Retries and re-registration, against a tiny fake daemon that fails on cue.

Only UNAVAILABLE is retried, only for idempotent calls; a lost session is
registered again and the call replayed unless it carries an old session's id.
"""
import asyncio
import os
import tempfile

import grpc
import pytest

from kvkeeper.client import AsyncClient, call_with_retry, call_with_retry_sync
from kvkeeper.client.errors import (DeadlineExceededError, FailedPreconditionError,
                                    NotFoundError, ResourceExhaustedError, UnavailableError,
                                    from_rpc_error, is_session_lost)
from kvkeeper.client.retry import backoff_delay
from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

NS = {"model_id": "m", "block_tokens": 16, "block_bytes": 64}
KEY = b"k" * 32
U = grpc.StatusCode.UNAVAILABLE


def rpc_error(code, details="boom"):
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


# ---- the helper alone


def test_backoff_grows_and_is_capped():
    assert backoff_delay(0, 0.1, 2.0, rand=lambda: 0.0) == pytest.approx(0.05)
    assert backoff_delay(0, 0.1, 2.0, rand=lambda: 0.999999) == pytest.approx(0.1, rel=1e-5)
    assert backoff_delay(3, 0.1, 2.0, rand=lambda: 0.0) == pytest.approx(0.4)
    assert backoff_delay(30, 0.1, 2.0, rand=lambda: 0.0) == pytest.approx(1.0)
    for a in range(10):
        assert 0 < backoff_delay(a) <= 2.0


async def test_call_with_retry_retries_unavailable_only():
    calls, slept = [], []

    async def sleep(d):
        slept.append(d)

    async def flaky():
        calls.append(1)
        if len(calls) < 3:
            raise rpc_error(U)
        return "ok"

    assert await call_with_retry(flaky, max_retries=5, sleep=sleep, rand=lambda: 0.0) == "ok"
    assert len(calls) == 3 and slept == [pytest.approx(0.05), pytest.approx(0.1)]

    async def deadline():
        calls.append(1)
        raise rpc_error(grpc.StatusCode.DEADLINE_EXCEEDED)

    calls.clear()
    with pytest.raises(grpc.aio.AioRpcError):
        await call_with_retry(deadline, max_retries=5, sleep=sleep)
    assert len(calls) == 1


async def test_call_with_retry_gives_up():
    calls = []

    async def down():
        calls.append(1)
        raise rpc_error(U)

    async def sleep(d):
        pass

    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call_with_retry(down, max_retries=3, sleep=sleep)
    assert info.value.code() == U and len(calls) == 4


def test_call_with_retry_sync():
    calls = []

    def flaky():
        calls.append(1)
        if len(calls) < 2:
            raise rpc_error(U)
        return 7

    assert call_with_retry_sync(flaky, max_retries=1, sleep=lambda d: None) == 7
    calls.clear()
    with pytest.raises(grpc.RpcError):
        call_with_retry_sync(flaky, max_retries=0, sleep=lambda d: None)


def test_error_mapping():
    e = from_rpc_error(rpc_error(grpc.StatusCode.RESOURCE_EXHAUSTED, "full"), "ReserveSave")
    assert isinstance(e, ResourceExhaustedError)
    assert e.code == grpc.StatusCode.RESOURCE_EXHAUSTED and e.details == "ReserveSave: full"
    assert isinstance(from_rpc_error(rpc_error(U)), UnavailableError)
    assert is_session_lost(rpc_error(grpc.StatusCode.NOT_FOUND, "unknown session abc: register"))
    assert is_session_lost(rpc_error(grpc.StatusCode.FAILED_PRECONDITION, "session abc expired"))
    assert not is_session_lost(rpc_error(grpc.StatusCode.NOT_FOUND, "unknown lease 4"))
    assert not is_session_lost(rpc_error(U, "unknown session"))


# ---- against a fake daemon


class Flaky(pb_grpc.KVKeeperServicer):
    """Answers from a script: faults[rpc] is a list of (code, details) to fail with first."""

    def __init__(self):
        self.faults = {}
        self.calls = {}
        self.sessions = []
        self.ttl = 30.0

    async def _gate(self, rpc, context, session_id=None):
        self.calls[rpc] = self.calls.get(rpc, 0) + 1
        queue = self.faults.get(rpc)
        if queue:
            code, details = queue.pop(0)
            await context.abort(code, details.format(sid=session_id))
        if session_id is not None and session_id not in self.sessions[-1:]:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {session_id}")

    async def RegisterSession(self, request, context):
        await self._gate("RegisterSession", context)
        self.sessions.append(f"s{len(self.sessions) + 1}")
        return pb.RegisterSessionResponse(session_id=self.sessions[-1], lease_ttl_seconds=self.ttl,
                                          key_bytes=32, max_keys_per_call=1024)

    async def Heartbeat(self, request, context):
        await self._gate("Heartbeat", context, request.session_id)
        return pb.HeartbeatResponse(lease_ttl_seconds=self.ttl)

    async def CloseSession(self, request, context):
        self.close_deadline = context.time_remaining()
        return pb.CloseSessionResponse()

    async def Match(self, request, context):
        await self._gate("Match", context, request.session_id)
        return pb.MatchResponse(matched=0, lease_id=0)

    async def ReserveSave(self, request, context):
        await self._gate("ReserveSave", context, request.session_id)
        return pb.ReserveSaveResponse(slots=[pb.SaveSlot(status=pb.SLOT_PRESENT)] * len(request.keys))

    async def Release(self, request, context):
        await self._gate("Release", context, request.session_id)
        return pb.ReleaseResponse()

    async def Stats(self, request, context):
        await self._gate("Stats", context)
        return pb.StatsResponse(version="fake")


@pytest.fixture(params=["tcp", "unix"])
async def flaky(request):
    servicer = Flaky()
    server = grpc.aio.server()
    pb_grpc.add_KVKeeperServicer_to_server(servicer, server)
    with tempfile.TemporaryDirectory() as tmp:
        if request.param == "tcp":
            port = server.add_insecure_port("127.0.0.1:0")
            url = f"127.0.0.1:{port}"
        else:
            path = os.path.join(tmp, "kvkeeper.sock")
            server.add_insecure_port(f"unix:{path}")
            url = f"unix://{path}"
        await server.start()
        try:
            yield servicer, url
        finally:
            await server.stop(None)


async def test_connect_retries_unavailable(flaky):
    fake, url = flaky
    fake.faults["RegisterSession"] = [(U, "shutting down")] * 2
    async with await AsyncClient.connect(url, NS, transport="stream") as c:
        assert c.session_id == "s1" and c.key_bytes == 32
        assert fake.calls["RegisterSession"] == 3


async def test_gives_up_after_max_retries(flaky):
    fake, url = flaky
    fake.faults["RegisterSession"] = [(U, "shutting down")] * 3
    with pytest.raises(UnavailableError):
        await AsyncClient.connect(url, NS, max_retries=2, transport="stream")
    assert fake.calls["RegisterSession"] == 3


async def test_idempotent_calls_retry_others_do_not(flaky):
    fake, url = flaky
    async with await AsyncClient.connect(url, NS, transport="stream") as c:
        fake.faults["Stats"] = [(U, "x")] * 2
        assert (await c.stats()).version == "fake"
        assert fake.calls["Stats"] == 3

        fake.faults["Match"] = [(U, "x")]
        assert (await c.match([KEY])).matched == 0
        assert fake.calls["Match"] == 2

        fake.faults["Match"] = [(U, "x")]  # a leased match is not replayed
        with pytest.raises(UnavailableError):
            await c.match([KEY], lease=True)
        assert fake.calls["Match"] == 3

        fake.faults["ReserveSave"] = [(U, "x")]
        with pytest.raises(UnavailableError):
            await c.save([KEY], [bytes(64)])
        assert fake.calls["ReserveSave"] == 1

        fake.faults["Release"] = [(U, "x")]
        await c.release(5)
        assert fake.calls["Release"] == 2

        fake.faults["Release"] = [(grpc.StatusCode.DEADLINE_EXCEEDED, "slow")]
        with pytest.raises(DeadlineExceededError):
            await c.release(5)
        assert fake.calls["Release"] == 3

        fake.faults["ReserveSave"] = [(grpc.StatusCode.RESOURCE_EXHAUSTED, "full")]
        with pytest.raises(ResourceExhaustedError):
            await c.save([KEY], [bytes(64)])


async def test_lost_session_is_registered_again(flaky):
    fake, url = flaky
    async with await AsyncClient.connect(url, NS, transport="stream") as c:
        fake.sessions.append("restarted")  # the daemon forgot s1
        res = await c.match([KEY])
        assert res.matched == 0 and c.session_id == "s3"  # "restarted" skipped: s3 is new
        assert fake.calls["Match"] == 2

        fake.faults["ReserveSave"] = [(grpc.StatusCode.FAILED_PRECONDITION,
                                       "session {sid} expired: register again")]
        assert (await c.save([KEY], [bytes(64)])).present == 1
        assert c.session_id == "s4"

        fake.sessions.append("gone")  # a lease of the old session is not replayed
        with pytest.raises(NotFoundError):
            await c.release(9)
        assert c.session_id == "s4" and fake.calls["Release"] == 1


async def test_heartbeat_registers_again():
    fake = Flaky()
    fake.ttl = 0.3
    server = grpc.aio.server()
    pb_grpc.add_KVKeeperServicer_to_server(fake, server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    try:
        async with await AsyncClient.connect(f"127.0.0.1:{port}", NS, transport="stream") as c:
            await asyncio.sleep(0.35)
            assert fake.calls.get("Heartbeat", 0) >= 2
            fake.faults["Heartbeat"] = [(grpc.StatusCode.FAILED_PRECONDITION,
                                         "session {sid} expired")]
            fake.faults["Heartbeat"] += [(grpc.StatusCode.INTERNAL, "oops")]  # logged only
            for _ in range(40):
                await asyncio.sleep(0.05)
                if c.session_id != "s1":
                    break
            assert c.session_id == "s2"
            await asyncio.sleep(0.25)
            assert c.session_id == "s2"  # INTERNAL is only logged
    finally:
        await server.stop(None)


async def test_renew_registers_again_after_a_restart_and_raises_while_down(flaky):
    fake, url = flaky
    async with await AsyncClient.connect(url, NS, transport="stream", max_retries=1) as c:
        await c.renew()
        assert c.session_id == "s1" and fake.calls["RegisterSession"] == 1
        fake.sessions.append("restarted")   # the daemon forgot s1
        await c.renew()
        assert c.session_id == "s3" and fake.calls["RegisterSession"] == 2
        fake.faults["Heartbeat"] = [(U, "down")] * 2   # every try of the one retry
        with pytest.raises(UnavailableError):
            await c.renew()
        assert c.session_id == "s3"


async def test_close_gives_close_session_the_deadline_asked_for(flaky):
    fake, url = flaky
    c = await AsyncClient.connect(url, NS, transport="stream", timeout=30.0)
    await c.close(timeout=0.5)
    assert 0 < fake.close_deadline < 1.0   # the deadline sent, not a duration measured
    c = await AsyncClient.connect(url, NS, transport="stream", timeout=30.0)
    await c.close()
    assert fake.close_deadline > 10.0


async def test_shm_transport_requires_an_arena(flaky):
    fake, url = flaky
    with pytest.raises(FailedPreconditionError):
        await AsyncClient.connect(url, NS, transport="shm")
    c = await AsyncClient.connect(url, NS)  # auto: falls back to streaming
    assert c.transport == "stream"
    await c.close()
    await c.close()
    with pytest.raises(RuntimeError):
        await c.stats()
