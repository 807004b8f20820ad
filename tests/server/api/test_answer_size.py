"""Answers that would exceed the daemon's own server.max_message_bytes (which
grpc refuses to send): Match(blocks) answers without the refs rather than lose
the lease it granted, and Load says RESOURCE_EXHAUSTED and what to do. Found
while fuzzing the stubs with a small limit."""
from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvkeeper.client import AsyncClient, ResourceExhaustedError
from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

LIMIT = 64 * 1024
N = 1500          # keys fit a request (34 B each), their refs (~46 B each) do not fit an answer


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [(salt << 24 | i).to_bytes(4, "little") * 8 for i in range(n)]


@pytest.fixture
async def small(daemon_factory: Any) -> Any:
    return await daemon_factory(**{"server.max_message_bytes": LIMIT,
                                   "host_tier.capacity_bytes": 4096 * (2 * N + 2)})


async def session(stub: Any) -> str:
    return (await stub.RegisterSession(pb.RegisterSessionRequest(namespace=pb.NamespaceDescriptor(
        model_id="m", dtype="float16", block_tokens=16, block_bytes=4096)))).session_id


async def test_match_with_blocks_keeps_its_lease_reachable_and_load_says_why(small: Any) -> None:
    async with grpc.aio.insecure_channel(f"unix:{small.socket_path}") as ch:
        stub = pb_grpc.KVKeeperStub(ch)
        sid = await session(stub)
        r = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=keys(N),
                                                         transport=pb.TRANSPORT_SHM))
        assert len(r.slots) == N   # one extent each: this answer fits
        await stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=r.reservation_id))
        m = await stub.Match(pb.MatchRequest(session_id=sid, keys=keys(N), lease=True, blocks=True))
        assert m.matched == N and m.lease_id and not m.blocks
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await stub.Load(pb.LoadRequest(session_id=sid, lease_id=m.lease_id))
        assert info.value.code() == grpc.StatusCode.RESOURCE_EXHAUSTED
        assert "server.max_message_bytes" in info.value.details()
        # The lease is the caller's to release; a smaller one loads.
        await stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=m.lease_id))
        m = await stub.Match(pb.MatchRequest(session_id=sid, keys=keys(100), lease=True, blocks=True))
        assert len(m.blocks) == 100
        assert len((await stub.Load(pb.LoadRequest(session_id=sid, lease_id=m.lease_id))).blocks) == 100
    assert list(small.ledger.leases) == [m.lease_id]


async def test_the_client_gets_a_clear_error_and_holds_no_lease(small: Any) -> None:
    ns = dict(model_id="m", dtype="float16", block_tokens=16, block_bytes=4096)
    async with await AsyncClient.connect(f"unix://{small.socket_path}", ns, max_retries=0) as c:
        await c.save(keys(N, 2), [bytes(4096)] * N)
        with pytest.raises(ResourceExhaustedError, match="max_message_bytes"):
            await c.match(keys(N, 2), lease=True, blocks=True)
        assert not small.ledger.leases
