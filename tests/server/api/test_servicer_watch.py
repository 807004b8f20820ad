"""WatchSession on the wire: the call's end from the client's side ends its
session and frees its leases; a session that ends ends the call; a session
nobody watches is left alone; a stopping daemon ends every watch at once.
Raw stubs on the real daemon's socket."""
from __future__ import annotations

import asyncio
import time
from typing import Any, Callable

import grpc
import pytest

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

BLOCK = 4096
POLL_S = 10.0   # a bound on conditions that come within milliseconds


def descriptor() -> pb.NamespaceDescriptor:
    return pb.NamespaceDescriptor(model_id="watch-test", block_tokens=32, block_bytes=BLOCK)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


async def until(cond: Callable[[], bool], what: str) -> None:
    deadline = time.monotonic() + POLL_S
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.005)


async def leased_session(stub: Any, k: int) -> tuple[str, int]:
    """A new session holding a lease on one committed block (key k)."""
    sid = (await stub.RegisterSession(pb.RegisterSessionRequest(
        instance_id="t", namespace=descriptor()))).session_id
    r = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=[key(k)],
                                                     transport=pb.TRANSPORT_STREAM))

    async def chunks():
        yield pb.WriteChunk(session_id=sid, reservation_id=r.reservation_id, index=0,
                            data=bytes(BLOCK))
    await stub.WriteBlocks(chunks())
    await stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=r.reservation_id))
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=[key(k)], lease=True))
    assert m.lease_id
    return sid, m.lease_id


def ended(daemon: Any, reason: str) -> int:
    return daemon.ledger.session_ends[reason]


async def test_a_dropped_watch_frees_the_session_a_session_without_one_stays(daemon: Any) -> None:
    url = f"unix:{daemon.socket_path}"
    watched = grpc.aio.insecure_channel(url)
    plain = grpc.aio.insecure_channel(url)
    try:
        s1, lease1 = await leased_session(pb_grpc.KVKeeperStub(watched), 1)
        s2, lease2 = await leased_session(pb_grpc.KVKeeperStub(plain), 2)
        call = pb_grpc.KVKeeperStub(watched).WatchSession(pb.WatchSessionRequest(session_id=s1))
        first = await call.read()
        assert first.ended == pb.SESSION_END_UNSPECIFIED
        assert len(daemon.ledger.sessions[s1].watches) == 1
        # Both clients vanish; only the watched one can be noticed.
        await plain.close()
        await watched.close()
        await until(lambda: s1 not in daemon.ledger.sessions, "the watched session stayed")
        L = daemon.ledger
        assert lease1 not in L.leases and ended(daemon, "disconnected") == 1
        assert s2 in L.sessions and lease2 in L.leases, "a session nobody watches lives on"
        assert ended(daemon, "closed") == ended(daemon, "expired") == 0
        assert len(daemon.servicer.watches) == 0
        L.check_invariants()
    finally:
        await plain.close()
        await watched.close()


async def test_cancelling_the_watch_is_the_same_as_a_lost_connection(daemon: Any, stub: Any) -> None:
    sid, lease = await leased_session(stub, 3)
    call = stub.WatchSession(pb.WatchSessionRequest(session_id=sid))
    await call.read()
    call.cancel()
    await until(lambda: sid not in daemon.ledger.sessions, "the session stayed")
    assert lease not in daemon.ledger.leases and ended(daemon, "disconnected") == 1
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await stub.Heartbeat(pb.HeartbeatRequest(session_id=sid))
    assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION


@pytest.mark.parametrize("how", ["closed", "expired"])
async def test_a_session_that_ends_ends_its_watch_saying_why(daemon: Any, stub: Any,
                                                           how: str) -> None:
    sid, _ = await leased_session(stub, 4)
    call = stub.WatchSession(pb.WatchSessionRequest(session_id=sid))
    await call.read()
    if how == "closed":
        await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    else:
        daemon.ledger.expire(time.monotonic() + 10 * daemon.ledger.config.lease_ttl_s)
    last = await call.read()
    assert last.ended == {"closed": pb.SESSION_END_CLOSED, "expired": pb.SESSION_END_EXPIRED}[how]
    assert await call.read() is grpc.aio.EOF
    assert await call.code() == grpc.StatusCode.OK
    assert ended(daemon, how) == 1 and ended(daemon, "disconnected") == 0
    await until(lambda: len(daemon.servicer.watches) == 0, "the watch was not let go")


async def test_watching_a_session_one_does_not_have_is_not_found(daemon: Any, stub: Any) -> None:
    call = stub.WatchSession(pb.WatchSessionRequest(session_id="7-0123456789abcdef"))
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.NOT_FOUND
    assert "unknown session" in info.value.details()
    text = daemon.metrics.render().decode()
    assert 'kvkeeper_rpc_errors_total{code="NOT_FOUND",method="WatchSession"} 1.0' in text
    # A held call has no duration: its series would say how long clients live.
    assert 'kvkeeper_rpc_duration_seconds_count{method="WatchSession"}' not in text


async def test_a_stopping_daemon_ends_every_watch_without_waiting_its_grace(daemon: Any,
                                                                           stub: Any) -> None:
    sid, _ = await leased_session(stub, 5)
    call = stub.WatchSession(pb.WatchSessionRequest(session_id=sid))
    await call.read()
    # A watch never ends by itself: were it not ended, stop() would wait the full grace.
    await asyncio.wait_for(daemon.stop(600.0), timeout=60.0)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await call.read()
    assert info.value.code() == grpc.StatusCode.UNAVAILABLE
    assert ended(daemon, "disconnected") == 0, "a daemon that stops ends no session"


async def test_session_ends_are_exported_by_reason(daemon: Any, stub: Any) -> None:
    sid, _ = await leased_session(stub, 6)
    await stub.CloseSession(pb.CloseSessionRequest(session_id=sid))
    sid, _ = await leased_session(stub, 7)
    call = stub.WatchSession(pb.WatchSessionRequest(session_id=sid))
    await call.read()
    call.cancel()
    await until(lambda: sid not in daemon.ledger.sessions, "the session stayed")
    text = daemon.metrics.render().decode()
    for reason, n in (("closed", 1), ("expired", 0), ("disconnected", 1)):
        assert f'kvkeeper_sessions_ended_total{{reason="{reason}"}} {n:.1f}' in text, reason
