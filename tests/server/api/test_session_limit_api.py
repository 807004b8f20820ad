"""[ledger] max_sessions_per_identity over gRPC: one more RegisterSession is
RESOURCE_EXHAUSTED naming the key; closing one gives the room back."""
from __future__ import annotations

from typing import Any

import grpc
from test_servicer_errors import expect

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc


def register(stub: Any) -> Any:
    return stub.RegisterSession(pb.RegisterSessionRequest(
        instance_id="e", namespace=pb.NamespaceDescriptor(model_id="m", block_tokens=32,
                                                          block_bytes=4096)))


async def test_the_session_limit_refuses_one_more_until_one_closes(daemon_factory: Any) -> None:
    d = await daemon_factory(**{"ledger.max_sessions_per_identity": "2"})
    async with grpc.aio.insecure_channel(f"unix:{d.socket_path}") as ch:
        stub = pb_grpc.KVKeeperStub(ch)
        first = (await register(stub)).session_id
        await register(stub)
        await expect(grpc.StatusCode.RESOURCE_EXHAUSTED, register(stub),
                     "ledger.max_sessions_per_identity")
        assert len(d.ledger.sessions) == 2
        await stub.CloseSession(pb.CloseSessionRequest(session_id=first))
        await register(stub)
        assert len(d.ledger.sessions) == 2
