"""The residency service under bearer tokens: a token limited to some models
locates and watches only their namespaces; reports are session-scoped, so
another identity's session id is an unknown one."""
from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc
from kvkeeper.v1 import residency_pb2 as rpb
from kvkeeper.v1 import residency_pb2_grpc as rpb_grpc

TOKEN_A, TOKEN_OPS = "res-tenant-a-0123456789abcdef", "res-ops-0123456789abcdefghij"
TOKENS = (f'[tokens.tenant-a]\ntoken = "{TOKEN_A}"\nmodels = ["model-a"]\nadmin = false\n\n'
          f'[tokens.ops]\ntoken = "{TOKEN_OPS}"\nmodels = ["*"]\nadmin = true\n')


def desc(model: str) -> pb.NamespaceDescriptor:
    return pb.NamespaceDescriptor(model_id=model, block_tokens=32, block_bytes=4096)


def md(token: str) -> tuple:
    return (("authorization", f"Bearer {token}"),)


async def code_of(call: Any) -> Any:
    try:
        r = await call
    except grpc.aio.AioRpcError as e:
        return e.code()
    return r


async def test_a_limited_token_sees_only_its_models(daemon_factory: Any, tmp_path: Any) -> None:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS)
    path.chmod(0o600)
    d = await daemon_factory(**{"auth.tokens_file": str(path)})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{d.port}") as ch:
        data, res = pb_grpc.KVKeeperStub(ch), rpb_grpc.KVKeeperResidencyStub(ch)
        sid = (await data.RegisterSession(pb.RegisterSessionRequest(
            instance_id="a", namespace=desc("model-a")), metadata=md(TOKEN_A))).session_id
        ns_ops = (await data.RegisterSession(pb.RegisterSessionRequest(
            instance_id="o", namespace=desc("model-b")), metadata=md(TOKEN_OPS))).namespace_id
        r = await res.ReportResidency(rpb.ReportResidencyRequest(
            session_id=sid, capacity_blocks=4, changes=[rpb.ResidencyChange(
                kind=rpb.RESIDENCY_STORED, keys=[bytes(32)])]), metadata=md(TOKEN_A))
        assert r.resident_blocks == 1
        # Another identity with tenant-a's session id: unknown.
        assert await code_of(res.ReportResidency(rpb.ReportResidencyRequest(
            session_id=sid, capacity_blocks=4), metadata=md(TOKEN_OPS))) == \
            grpc.StatusCode.NOT_FOUND
        own = await res.Locate(rpb.LocateRequest(descriptor=desc("model-a"), keys=[bytes(32)]),
                               metadata=md(TOKEN_A))
        assert own.engines[0].prefix == 1
        for req in (rpb.LocateRequest(descriptor=desc("model-b"), keys=[bytes(32)]),
                    rpb.LocateRequest(namespace_id=ns_ops, keys=[bytes(32)])):
            assert await code_of(res.Locate(req, metadata=md(TOKEN_A))) == \
                grpc.StatusCode.PERMISSION_DENIED
        assert (await res.Locate(rpb.LocateRequest(namespace_id=ns_ops, keys=[bytes(32)]),
                                 metadata=md(TOKEN_OPS))).namespace_id == ns_ops
        # Watching every namespace needs a token that covers every model.
        call = res.WatchEvents(rpb.WatchEventsRequest(), metadata=md(TOKEN_A))
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await call.read()
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        call = res.WatchEvents(rpb.WatchEventsRequest(descriptor=desc("model-a")),
                               metadata=md(TOKEN_A))
        assert (await call.read()).epoch
        call.cancel()
        call = res.WatchEvents(rpb.WatchEventsRequest(), metadata=md(TOKEN_OPS))
        assert (await call.read()).epoch
        call.cancel()
