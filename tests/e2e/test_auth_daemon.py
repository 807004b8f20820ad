"""Authentication and isolation against a real daemon: which listeners start,
tokens (wrong, missing, another tenant's), quotas, admin rights, mutual TLS and
the socket's group."""
from __future__ import annotations

import grp
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvkeeper.client import AsyncClient, KVKeeperClientError, ResourceExhaustedError
from kvkeeper.client.auth import TLS
from kvkeeper.server.app import create_server
from kvkeeper.server.config import ConfigError
from kvkeeper.v1 import admin_pb2 as apb
from kvkeeper.v1 import admin_pb2_grpc as apb_grpc

from pki import make_pki, openssl


BLOCK = 4096
TOKEN_A = "tenant-a-0123456789abcdef"
TOKEN_B = "tenant-b-0123456789abcdef"
TOKEN_OPS = "ops-0123456789abcdefghij"
TOKENS = f"""
[tokens.tenant-a]
token = "{TOKEN_A}"
models = ["model-a"]

[tokens.tenant-b]
token = "{TOKEN_B}"
models = ["model-b"]

[tokens.ops]
token = "{TOKEN_OPS}"
models = ["*"]
admin = true

[quotas]
"model-b" = "{3 * BLOCK}"
"""


def ns(model: str) -> dict:
    return dict(model_id=model, dtype="float16", kv_layout="NHD", block_tokens=16,
                block_bytes=BLOCK)


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [(salt * 1000 + i).to_bytes(4, "little") * 8 for i in range(n)]


def data(n: int, seed: int = 0) -> list[bytes]:
    return [bytes([(seed + i) % 251]) * BLOCK for i in range(n)]


@pytest.fixture
def tokens_file(tmp_path: Path) -> str:
    p = tmp_path / "tokens.toml"
    p.write_text(TOKENS)
    p.chmod(0o600)
    return str(p)


@pytest.fixture
async def secured(daemon_factory: Any, tokens_file: str) -> Any:
    return await daemon_factory(**{"auth.tokens_file": tokens_file})


def tcp(d: Any) -> str:
    return f"127.0.0.1:{d.port}"


async def connect(url: str, model: str, **kw: Any) -> AsyncClient:
    return await AsyncClient.connect(url, ns(model), max_retries=0, **kw)


async def rejected(code: grpc.StatusCode, coro: Any) -> str:
    with pytest.raises(KVKeeperClientError) as info:
        await coro
    assert info.value.code == code, info.value
    return info.value.details


# --------------------------------------------------------------------------- listeners
async def test_loopback_tcp_without_tokens_works(daemon: Any) -> None:
    c = await connect(tcp(daemon), "model-a")
    try:
        assert (await c.save(keys(2), data(2))).committed == 2
        assert (await c.match(keys(2))).matched == 2
    finally:
        await c.close()


def test_non_loopback_tcp_without_credentials_refuses_to_start(daemon_config: Any) -> None:
    config = daemon_config(**{"listen.tcp": "0.0.0.0:0"})
    with pytest.raises(ConfigError) as info:
        create_server(config)
    assert info.value.key == "listen.tcp"
    # Refused before anything was created.
    assert not os.path.exists(config.listen.socket)
    assert not os.path.exists(os.path.join(config.host_tier.shm_dir, config.host_tier.name))


def test_serve_exits_2_on_a_non_loopback_listener_without_credentials(tmp_path: Path) -> None:
    out = subprocess.run(
        [sys.executable, "-m", "kvkeeper.server.cli", "serve", "--socket", "", "--tcp",
         "0.0.0.0:0", "--metrics", ""], cwd=tmp_path, capture_output=True, text=True, timeout=60,
        env={**os.environ, "KVKEEPER_CONFIG": ""})
    assert out.returncode == 2, out.stderr
    assert "config error" in out.stderr and "listen.tcp" in out.stderr
    assert "auth.tokens_file" in out.stderr


async def test_non_loopback_tcp_with_tokens_starts(daemon_factory: Any, tokens_file: str) -> None:
    d = await daemon_factory(**{"listen.tcp": "0.0.0.0:0", "auth.tokens_file": tokens_file})
    c = await connect(tcp(d), "model-a", token=TOKEN_A)
    await c.close()
    await rejected(grpc.StatusCode.UNAUTHENTICATED, connect(tcp(d), "model-a"))


# --------------------------------------------------------------------------- tokens
async def test_wrong_or_missing_token_is_unauthenticated(secured: Any) -> None:
    details = await rejected(grpc.StatusCode.UNAUTHENTICATED,
                             connect(tcp(secured), "model-a", token=TOKEN_A + "x"))
    assert "not valid" in details and TOKEN_A not in details
    assert "bearer token" in await rejected(grpc.StatusCode.UNAUTHENTICATED,
                                            connect(tcp(secured), "model-a"))
    # A token is checked on the unix socket too, when one is sent.
    await rejected(grpc.StatusCode.UNAUTHENTICATED,
                   connect(f"unix://{secured.socket_path}", "model-a", token="x" * 20))
    assert not secured.ledger.sessions


async def test_unix_socket_without_token_is_trusted(secured: Any) -> None:
    c = await connect(f"unix://{secured.socket_path}", "model-z")
    await c.close()


async def test_health_needs_no_token(secured: Any) -> None:
    async with grpc.aio.insecure_channel(tcp(secured)) as ch:
        r = await health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest())
        assert r.status == health_pb2.HealthCheckResponse.SERVING


async def test_another_tenants_namespace_is_permission_denied(secured: Any) -> None:
    b = await connect(tcp(secured), "model-b", token=TOKEN_B)
    try:
        await b.save(keys(3), data(3, seed=7))
        nsb = secured.ledger.namespaces[b.namespace_id]
        before = {k: (x.state, x.refs, x.hits) for k, x in nsb.blocks.items()}
        details = await rejected(grpc.StatusCode.PERMISSION_DENIED,
                                 connect(tcp(secured), "model-b", token=TOKEN_A))
        assert "'tenant-a' does not cover model 'model-b'" in details
        assert TOKEN_A not in details
        # Nothing of B's moved: no session, no lease, no hit, no eviction.
        assert {k: (x.state, x.refs, x.hits) for k, x in nsb.blocks.items()} == before
        assert nsb.sessions == 1
        m = await b.match(keys(3), lease=True)
        assert m.matched == 3 and await b.load(m.lease_id) == data(3, seed=7)
    finally:
        await b.close()


async def test_quota_exceeded_is_resource_exhausted(secured: Any) -> None:
    b = await connect(tcp(secured), "model-b", token=TOKEN_B)
    a = await connect(tcp(secured), "model-a", token=TOKEN_A)
    try:
        assert (await b.save(keys(3), data(3))).committed == 3
        with pytest.raises(ResourceExhaustedError, match=f"quota of {3 * BLOCK} B"):
            await b.save(keys(1, salt=1), data(1))
        assert (await a.save(keys(5), data(5))).committed == 5   # model-a has no quota
        assert (await b.match(keys(3))).matched == 3
    finally:
        await a.close()
        await b.close()


async def test_admin_needs_an_admin_token(secured: Any) -> None:
    async def ls(target: str, token: str | None) -> Any:
        md = (("authorization", f"Bearer {token}"),) if token else None
        async with grpc.aio.insecure_channel(target) as ch:
            return await apb_grpc.KVKeeperAdminStub(ch).ListNamespaces(
                apb.ListNamespacesRequest(), metadata=md)

    await ls(tcp(secured), TOKEN_OPS)
    await ls(f"unix:{secured.socket_path}", None)
    for token, code in ((TOKEN_A, grpc.StatusCode.PERMISSION_DENIED),
                        (None, grpc.StatusCode.UNAUTHENTICATED)):
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await ls(tcp(secured), token)
        assert info.value.code() == code
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await ls(f"unix:{secured.socket_path}", TOKEN_B)
    assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
    assert "admin = true" in info.value.details()


async def test_a_tenant_cannot_evict(secured: Any) -> None:
    b = await connect(tcp(secured), "model-b", token=TOKEN_B)
    try:
        await b.save(keys(2), data(2))
        async with grpc.aio.insecure_channel(tcp(secured)) as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await apb_grpc.KVKeeperAdminStub(ch).Evict(
                    apb.EvictRequest(all=True), metadata=(("authorization", f"Bearer {TOKEN_A}"),))
            assert info.value.code() == grpc.StatusCode.PERMISSION_DENIED
        assert (await b.match(keys(2))).matched == 2
    finally:
        await b.close()


# --------------------------------------------------------------------------- mutual TLS
@pytest.fixture(scope="module")
def pki() -> Any:
    if openssl() is None:
        pytest.skip("openssl is not installed")
    d = Path(tempfile.mkdtemp(prefix="kvk-pki-"))
    yield make_pki(d)
    shutil.rmtree(d, ignore_errors=True)


async def test_mutual_tls_admits_only_certified_clients(daemon_factory: Any, pki: Path) -> None:
    d = await daemon_factory(**{"listen.tcp": "0.0.0.0:0",
                                "tls.cert_file": str(pki / "server.pem"),
                                "tls.key_file": str(pki / "server.key"),
                                "tls.client_ca_file": str(pki / "ca.pem")})
    good = TLS(ca_file=str(pki / "ca.pem"), cert_file=str(pki / "client.pem"),
               key_file=str(pki / "client.key"))
    c = await connect(tcp(d), "model-a", tls=good)
    try:
        assert (await c.save(keys(1), data(1))).committed == 1
    finally:
        await c.close()
    for bad in (TLS(ca_file=str(pki / "ca.pem")), None):       # no certificate / no TLS
        with pytest.raises(KVKeeperClientError):
            await AsyncClient.connect(tcp(d), ns("model-a"), tls=bad, max_retries=0, timeout=2)


# --------------------------------------------------------------------------- socket group
def test_socket_and_arena_get_the_group(daemon_config: Any) -> Any:
    mine = os.getegid()
    if os.geteuid() == 0:
        gid = next((g.gr_gid for g in grp.getgrall() if g.gr_gid != mine), None)
    else:
        gid = next((g for g in os.getgroups() if g != mine), None)
    if gid is None:
        pytest.skip("no second group to hand the socket to")
    import asyncio

    async def check() -> None:
        d, _ = create_server(daemon_config(**{"listen.socket_group": str(gid)}))
        await d.start()
        try:
            assert os.stat(d.socket_path).st_gid == gid
            assert os.stat(d.arena.path).st_gid == gid
        finally:
            await d.stop(0)

    asyncio.run(check())


def test_an_unknown_socket_group_refuses_to_start(daemon_config: Any) -> None:
    config = daemon_config(**{"listen.socket_group": "no-such-group-kvk"})
    with pytest.raises(ConfigError, match="no such group"):
        create_server(config)
    assert not os.path.exists(os.path.join(config.host_tier.shm_dir, config.host_tier.name))


async def test_a_session_id_is_useless_to_another_token(secured: Any) -> None:
    """Tenant B holding tenant A's session id (say from a leaked log) gets the
    unknown-session answer, and A's session is untouched."""
    a = await connect(tcp(secured), "model-a", token=TOKEN_A)
    sid = a.session_id
    async with grpc.aio.insecure_channel(tcp(secured)) as ch:
        from kvkeeper.v1 import kvkeeper_pb2 as pb
        from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc
        stub = pb_grpc.KVKeeperStub(ch)
        md = (("authorization", f"Bearer {TOKEN_B}"),)
        answers = []
        for probe in (sid, "ff-0123456789abcdef"):
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await stub.CloseSession(pb.CloseSessionRequest(session_id=probe), metadata=md)
            answers.append((info.value.code(), info.value.details().replace(repr(probe), "<id>")))
        assert answers[0] == answers[1] and answers[0][0] == grpc.StatusCode.NOT_FOUND
    assert sid in secured.ledger.sessions
    assert (await a.match(keys(1))).matched == 0        # A's session still works, unchanged id
    assert a.session_id == sid
    await a.close()
