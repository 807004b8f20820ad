"""A leased Match whose caller gave up before the answer was ready grants no
lease that outlives the call (servicer.Match over gRPC, api/match_lane.py on
the lane): nobody would ever hear of it, and it would pin its blocks until
the session ends. The callers run on their own threads, with blocking
sockets and channels, so they give up while the daemon's loop is busy,
as a client in another process does."""
from __future__ import annotations

import asyncio
import socket
import struct
import time
from typing import Any

import grpc
from test_servicer_match_blocks import saved

from kvkeeper.client.match_lane import lane_path
from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

LEN = struct.Struct("<I")
GIVE_UP_S = 0.1
STALL_S = 0.4


def stall(daemon: Any, blocking: bool) -> None:
    """Make the stack's match take STALL_S: blocking the loop (a long
    synchronous stretch), or awaiting (a promotion from a lower tier)."""
    real = daemon.stack.match

    async def slow(*a: Any, **kw: Any) -> Any:
        if blocking:
            time.sleep(STALL_S)
        else:
            await asyncio.sleep(STALL_S)
        return await real(*a, **kw)
    daemon.stack.match = slow


def lane_caller(path: str, body: bytes, timeout: float) -> bytes:
    """One lane call from a blocking socket; b"" when it gave up."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
        s.connect(path)
        s.settimeout(timeout)
        s.sendall(LEN.pack(len(body)) + body)
        try:
            n = LEN.unpack(s.recv(4, socket.MSG_WAITALL))[0]
            return s.recv(n, socket.MSG_WAITALL)
        except socket.timeout:
            return b""


def grpc_caller(target: str, req: Any, timeout: float) -> Any:
    with grpc.insecure_channel(target) as ch:
        try:
            return pb_grpc.KVKeeperStub(ch).Match(req, timeout=timeout)
        except grpc.RpcError as e:
            return e.code()


async def settle(daemon: Any) -> None:
    """Until the stalled handler has finished (the loop ran it)."""
    await asyncio.sleep(STALL_S + 0.2)


async def test_a_lane_caller_that_gave_up_holds_no_lease(daemon: Any, stub: Any) -> None:
    sid, ks = await saved(stub, 3)
    body = pb.MatchRequest(session_id=sid, keys=ks, lease=True).SerializeToString()
    path = lane_path(daemon.socket_path)
    loop = asyncio.get_running_loop()
    for blocking in (True, False):
        stall(daemon, blocking)
        got = await loop.run_in_executor(None, lane_caller, path, body, GIVE_UP_S)
        assert got == b""
        await settle(daemon)
        assert not daemon.ledger.leases, f"blocking={blocking}"
        daemon.ledger.check_invariants()
    assert daemon.lane.unheard == 2
    # A caller that waits gets its lease, and keeps it.
    got = await loop.run_in_executor(None, lane_caller, path, body, 5.0)
    assert got[0] == 0
    lid = pb.MatchResponse.FromString(got[1:]).lease_id
    assert lid and lid in daemon.ledger.leases
    assert daemon.lane.unheard == 2


async def test_a_grpc_caller_that_gave_up_holds_no_lease(daemon: Any, stub: Any) -> None:
    sid, ks = await saved(stub, 3)
    req = pb.MatchRequest(session_id=sid, keys=ks, lease=True)
    target = f"unix:{daemon.socket_path}"
    loop = asyncio.get_running_loop()
    for blocking in (True, False):
        stall(daemon, blocking)
        got = await loop.run_in_executor(None, grpc_caller, target, req, GIVE_UP_S)
        assert got == grpc.StatusCode.DEADLINE_EXCEEDED
        await settle(daemon)
        assert not daemon.ledger.leases, f"blocking={blocking}"
        daemon.ledger.check_invariants()
    got = await loop.run_in_executor(None, grpc_caller, target, req, 5.0)
    assert got.lease_id and got.lease_id in daemon.ledger.leases
