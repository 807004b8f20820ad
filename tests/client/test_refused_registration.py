"""A lost session whose registration the daemon refuses (client/refusal.py),
against a real daemon: the refusal is remembered, so calls fail fast with its
class and message instead of each registering again, the watch and heartbeats
back off and log once, and the client recovers by itself once access returns.

The refusals: RESOURCE_EXHAUSTED (ledger.max_sessions_per_identity), and a
reload of the tokens file that takes the model from the token
(PERMISSION_DENIED) or removes the token (UNAUTHENTICATED)."""
from __future__ import annotations

import asyncio
import logging
import time
from typing import Any, Callable, Dict

import grpc
import pytest

from kvkeeper.client import (AsyncClient, PermissionDeniedError, ResourceExhaustedError,
                             UnauthenticatedError, is_session_lost)
from kvkeeper.client import refusal
from kvkeeper.client.refusal import Refusal
from kvkeeper.server.api.convert import descriptor_from_pb
from kvkeeper.server.security import identity
from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

PAGE = 4096
NS = {"model_id": "model-a", "block_tokens": 32, "block_bytes": PAGE}
KEY = b"\x01" * 32
TOKEN_A, TOKEN_OPS = "ref-tenant-a-0123456789abcdef", "ref-ops-0123456789abcdefghij"
TOKENS = (f'[tokens.tenant-a]\ntoken = "{TOKEN_A}"\nmodels = ["model-a"]\nadmin = false\n\n'
          f'[tokens.ops]\ntoken = "{TOKEN_OPS}"\nmodels = ["*"]\nadmin = true\n')


@pytest.fixture
def sent(monkeypatch: Any) -> Dict[str, int]:
    """RegisterSession and WatchSession calls the client's sessions make (the
    daemon's metrics miss the ones its auth interceptor refuses)."""
    counts = {"RegisterSession": 0, "WatchSession": 0}

    class CountingStub(pb_grpc.KVKeeperStub):
        def __init__(self, channel: Any) -> None:
            super().__init__(channel)
            for name in counts:
                setattr(self, name, counted(name, getattr(self, name)))

    def counted(name: str, fn: Any) -> Any:
        def call(*a: Any, **kw: Any) -> Any:
            counts[name] += 1
            return fn(*a, **kw)
        return call

    monkeypatch.setattr(pb_grpc, "KVKeeperStub", CountingStub)
    return counts


@pytest.fixture
def short_backoff(monkeypatch: Any) -> None:
    monkeypatch.setattr(refusal, "REFUSED_MIN_S", 0.2)
    monkeypatch.setattr(refusal, "REFUSED_MAX_S", 0.4)


def answered(d: Any, method: str) -> int:
    """RPCs of `method` the daemon answered."""
    return int(d.metrics.registry.get_sample_value(
        "kvkeeper_rpc_duration_seconds_count", {"method": method}) or 0)


async def until(cond: Callable[[], bool], what: str, within: float = 5.0) -> None:
    t = time.monotonic()
    while not cond():
        assert time.monotonic() - t < within, what
        await asyncio.sleep(0.01)


async def with_tokens(daemon_factory: Any, tmp_path: Any, **overrides: Any) -> Any:
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS)
    path.chmod(0o600)
    return await daemon_factory(**{"auth.tokens_file": str(path), **overrides}), path


def test_the_backoff_doubles_to_its_cap(clock: Any, short_backoff: None) -> None:
    r = Refusal(clock)
    err = ResourceExhaustedError("RegisterSession: full", grpc.StatusCode.RESOURCE_EXHAUSTED)
    r.check()                                # nothing refused: go ahead
    r.record(PermissionDeniedError("x", grpc.StatusCode.DEADLINE_EXCEEDED))
    assert r.error is None                   # not a refusal: not remembered
    r.record(err)
    assert r.wait() == pytest.approx(0.2) and r.holds()
    with pytest.raises(ResourceExhaustedError) as e:
        r.check()                            # no asking again within the backoff
    assert str(e.value) == str(err) and e.value is not err
    for wait in (0.4, 0.4):                  # doubled, capped
        clock.now += r.wait()
        r.check()
        r.record(err)
        assert r.wait() == pytest.approx(wait) and r.holds()
    assert r.clear() and not r.holds() and r.wait() == 0 and not r.clear()


async def test_a_refused_reregistration_fails_calls_fast_and_recovers(
        daemon_factory: Any, sent: Dict[str, int], short_backoff: None) -> None:
    d = await daemon_factory(**{"ledger.max_sessions_per_identity": "1"})
    url = f"unix://{d.socket_path}"
    async with grpc.aio.insecure_channel(f"unix:{d.socket_path}") as ch:
        raw = pb_grpc.KVKeeperStub(ch)
        c = await AsyncClient.connect(url, NS, timeout=2.0)
        try:
            # A second client is refused at connect, at once, as before.
            with pytest.raises(ResourceExhaustedError):
                await AsyncClient.connect(url, NS, timeout=2.0)
            old = c.session_id
            # The session ends and another takes the slot, before the client can.
            d.ledger.revoke([old])
            fid = d.ledger.register_session("f", descriptor_from_pb(pb.NamespaceDescriptor(**NS)),
                                            d.servicer.clock(), owner=identity.SOCKET).id
            r0, m0 = sent["RegisterSession"], answered(d, "Match")
            errors = []
            for _ in range(50):
                with pytest.raises(ResourceExhaustedError) as e:
                    await c.match([KEY])
                errors.append(str(e.value))
            assert len(set(errors)) == 1 and "RegisterSession" in errors[0]
            # The first refusal (and at most one more after its backoff); then no RPC.
            assert sent["RegisterSession"] - r0 <= 2
            assert answered(d, "Match") - m0 <= 2
            # The slot frees: the client is back within the backoff, by itself.
            await raw.CloseSession(pb.CloseSessionRequest(session_id=fid))
            await until(lambda: c.session_id != old, "not registered again", 2.0)
            assert (await c.match([KEY])).matched == 0
            assert len(d.ledger.sessions) == 1
        finally:
            await c.close()


async def test_a_revoked_model_backs_off_logs_once_and_recovers(
        daemon_factory: Any, tmp_path: Any, sent: Dict[str, int], short_backoff: None,
        caplog: Any) -> None:
    # Heartbeats every 0.1 s: an unlimited log would say so ten times a second.
    d, path = await with_tokens(daemon_factory, tmp_path, **{"ledger.lease_ttl_seconds": 0.3})
    granted = path.read_text()
    c = await AsyncClient.connect(f"127.0.0.1:{d.port}", NS, token=TOKEN_A, timeout=2.0)
    try:
        old = c.session_id
        caplog.set_level(logging.DEBUG, logger="kvkeeper.client")
        r0 = sent["RegisterSession"]
        path.write_text(granted.replace('models = ["model-a"]', 'models = ["model-c"]'))
        d.reload(d.config)
        await asyncio.sleep(1.2)              # no calls: heartbeats and the watch alone
        # Backoff 0.2 doubling to 0.4 s: about 4 in 1.2 s, not one per heartbeat and watch retry.
        assert sent["RegisterSession"] - r0 <= 6
        with pytest.raises(PermissionDeniedError, match="model-c"):
            await c.match([KEY])
        warned = [r for r in caplog.records if r.levelno >= logging.WARNING
                  and "heartbeat failed" in r.getMessage()]
        assert len(warned) == 1, [r.getMessage() for r in warned]
        path.write_text(granted)
        d.reload(d.config)
        await until(lambda: c.session_id != old, "not registered again without a call", 2.0)
        await until(lambda: any("heartbeats succeed again" in r.getMessage()
                                for r in caplog.records), "no word of the recovery", 2.0)
        assert (await c.match([KEY])).matched == 0 and len(d.ledger.sessions) == 1
    finally:
        await c.close()


async def test_a_removed_token_is_a_lost_session_that_backs_off(
        daemon_factory: Any, tmp_path: Any, sent: Dict[str, int], short_backoff: None) -> None:
    d, path = await with_tokens(daemon_factory, tmp_path)
    granted = path.read_text()
    c = await AsyncClient.connect(f"127.0.0.1:{d.port}", NS, token=TOKEN_A, timeout=2.0)
    try:
        old = c.session_id
        path.write_text("[tokens.ops]" + granted.split("[tokens.ops]")[1])
        d.reload(d.config)
        assert old not in d.ledger.sessions   # the daemon ended it: registering is the way back
        r0, w0 = sent["RegisterSession"], sent["WatchSession"]
        for _ in range(30):
            with pytest.raises(UnauthenticatedError, match="not valid") as e:
                await c.match([KEY])
            assert is_session_lost(e.value)
        await asyncio.sleep(0.5)
        assert sent["RegisterSession"] - r0 <= 4
        assert sent["WatchSession"] - w0 <= 4     # not the dead id at 2 Hz either
        path.write_text(granted)
        d.reload(d.config)
        await until(lambda: c.session_id != old, "not registered again without a call", 2.0)
        assert (await c.match([KEY])).matched == 0
    finally:
        await c.close()
