"""A reload that takes a model away from a token ends that token's sessions of
it at once: their leases and reservations go, their watches end
PERMISSION_DENIED, their next call says why; other sessions go on."""
from __future__ import annotations

import asyncio
from typing import Any

import grpc
import pytest
from test_api_integrity import reserve, save, with_tokens
from test_residency_auth import TOKEN_A, TOKEN_OPS, md
from test_servicer_errors import expect, key

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

PAGE = 4096


async def register(stub: Any, token: str, model: str) -> str:
    return (await stub.RegisterSession(pb.RegisterSessionRequest(
        instance_id="e", namespace=pb.NamespaceDescriptor(
            model_id=model, block_tokens=32, block_bytes=PAGE)), metadata=md(token))).session_id


class Tokened:
    """A stub whose every call carries `token` (the helpers shared with other tests take none)."""

    def __init__(self, stub: Any, token: str) -> None:
        self._stub, self._md = stub, md(token)

    def __getattr__(self, name: str) -> Any:
        method = getattr(self._stub, name)
        return lambda *a, **kw: method(*a, metadata=self._md, **kw)


async def test_narrowing_a_token_ends_its_sessions_of_the_models_it_lost(
        daemon_factory: Any, tmp_path: Any) -> None:
    d, path = await with_tokens(daemon_factory, tmp_path)
    ended = lambda: d.metrics.registry.get_sample_value(   # noqa: E731
        "kvkeeper_sessions_ended_total", {"reason": "revoked"})
    async with grpc.aio.insecure_channel(f"127.0.0.1:{d.port}") as ch:
        raw = pb_grpc.KVKeeperStub(ch)
        a, ops = Tokened(raw, TOKEN_A), Tokened(raw, TOKEN_OPS)
        sid = await register(raw, TOKEN_A, "model-a")
        other = await register(raw, TOKEN_OPS, "model-a")
        await save(a, sid, [key(1), key(2)], b"a")
        lease = (await a.Match(pb.MatchRequest(session_id=sid, keys=[key(1), key(2)],
                                               lease=True))).lease_id
        res = (await reserve(a, sid, [key(3)])).reservation_id
        watch = a.WatchSession(pb.WatchSessionRequest(session_id=sid))
        await watch.read()
        assert lease in d.ledger.leases and res in d.ledger.reservations
        # The operator takes model-a away from tenant-a (the token itself stays).
        path.write_text(path.read_text().replace('models = ["model-a"]', 'models = ["model-c"]'))
        d.reload(d.config)
        assert sid not in d.ledger.sessions and other in d.ledger.sessions
        assert lease not in d.ledger.leases and res not in d.ledger.reservations
        assert ended() == 1
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(watch.read(), 5)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert "no longer covers" in e.value.details()
        await expect(grpc.StatusCode.FAILED_PRECONDITION,
                     a.Match(pb.MatchRequest(session_id=sid, keys=[key(1)])), "no longer covers")
        await expect(grpc.StatusCode.PERMISSION_DENIED,
                     a.RegisterSession(pb.RegisterSessionRequest(
                         instance_id="e", namespace=pb.NamespaceDescriptor(
                             model_id="model-a", block_tokens=32, block_bytes=PAGE))), "model-c")
        # The blocks stay, for the tokens that still cover the model.
        assert (await ops.Match(pb.MatchRequest(session_id=other,
                                                keys=[key(1), key(2)]))).matched == 2
        # A second reload of the same file ends nothing more.
        d.reload(d.config)
        assert other in d.ledger.sessions and ended() == 1
        # A token removed from the file: its sessions end too.
        sid_c = await register(raw, TOKEN_A, "model-c")
        path.write_text(path.read_text().split("[tokens.tenant-a]")[0]
                        + "[tokens.ops]" + path.read_text().split("[tokens.ops]")[1])
        d.reload(d.config)
        assert sid_c not in d.ledger.sessions and ended() == 2
        assert len(d.tokens.grants) == 1 and other in d.ledger.sessions
        await expect(grpc.StatusCode.UNAUTHENTICATED,
                     a.Heartbeat(pb.HeartbeatRequest(session_id=sid_c)), "not valid")


async def test_a_refused_tokens_file_ends_no_session(daemon_factory: Any, tmp_path: Any) -> None:
    d, path = await with_tokens(daemon_factory, tmp_path)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{d.port}") as ch:
        sid = await register(pb_grpc.KVKeeperStub(ch), TOKEN_A, "model-a")
    path.write_text("[tokens.tenant-a]\ntoken = \"short\"\n")     # does not parse: refused
    d.reload(d.config)
    assert sid in d.ledger.sessions and len(d.tokens.grants) == 2


async def test_the_client_of_a_revoked_session_gets_a_clear_error_and_recovers_when_granted(
        daemon_factory: Any, tmp_path: Any, monkeypatch: Any) -> None:
    """The client library: its next call registers again, is refused with the
    token's models named, and works again once the model is granted back
    (within the refusal's backoff: client/refusal.py)."""
    from kvkeeper.client import AsyncClient, PermissionDeniedError, refusal

    monkeypatch.setattr(refusal, "REFUSED_MIN_S", 0.05)

    d, path = await with_tokens(daemon_factory, tmp_path)
    granted = path.read_text()
    c = await AsyncClient.connect(f"127.0.0.1:{d.port}", {"model_id": "model-a",
                                                          "block_tokens": 32,
                                                          "block_bytes": PAGE},
                                  token=TOKEN_A, transport="stream", timeout=5.0)
    try:
        assert (await c.match([key(1)])).matched == 0
        path.write_text(granted.replace('models = ["model-a"]', 'models = ["model-c"]'))
        d.reload(d.config)
        with pytest.raises(PermissionDeniedError, match="model-c"):
            await c.match([key(1)])
        path.write_text(granted)
        d.reload(d.config)
        for _ in range(100):   # the refusal's backoff, then the call registers again
            try:
                assert (await c.match([key(1)])).matched == 0
                break
            except PermissionDeniedError:
                await asyncio.sleep(0.02)
        else:
            raise AssertionError("the client did not recover once the model was granted back")
        assert len(d.ledger.sessions) == 1
    finally:
        await c.close()


async def test_a_watch_of_events_ends_once_its_token_lost_the_model(daemon_factory: Any,
                                                                    tmp_path: Any) -> None:
    """WatchEvents checks the token when it starts; after a reload took the
    model away, the next batch is refused rather than sent."""
    from kvkeeper.v1 import residency_pb2 as rpb
    from kvkeeper.v1 import residency_pb2_grpc as rpb_grpc

    d, path = await with_tokens(daemon_factory, tmp_path)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{d.port}") as ch:
        raw = pb_grpc.KVKeeperStub(ch)
        ops = Tokened(raw, TOKEN_OPS)
        other = await register(raw, TOKEN_OPS, "model-a")
        call = rpb_grpc.KVKeeperResidencyStub(ch).WatchEvents(
            rpb.WatchEventsRequest(descriptor=pb.NamespaceDescriptor(
                model_id="model-a", block_tokens=32, block_bytes=PAGE)), metadata=md(TOKEN_A))
        await call.read()                                   # the head
        await save(ops, other, [key(1)], b"a")
        got = await asyncio.wait_for(call.read(), 5)
        assert [bytes(k) for e in got.events for k in e.keys] == [key(1)]
        path.write_text(path.read_text().replace('models = ["model-a"]', 'models = ["model-c"]'))
        d.reload(d.config)
        await save(ops, other, [key(2)], b"b")
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await asyncio.wait_for(call.read(), 5)
        assert e.value.code() == grpc.StatusCode.PERMISSION_DENIED
