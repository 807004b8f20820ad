"""The admin service (kvkeeper.v1.KVKeeperAdmin) against a real daemon, over raw stubs:
ls, inspect, evict, drain and verify, their errors, and turning the service off."""
from __future__ import annotations

import asyncio
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvkeeper.client import AsyncClient, UnavailableError
from kvkeeper.server.ledger.disk_index import STORED
from kvkeeper.v1 import admin_pb2 as apb
from kvkeeper.v1 import admin_pb2_grpc as apb_grpc
from kvkeeper.v1 import kvkeeper_pb2 as pb

BLOCK = 4096 + 100  # two pages


def ns(model: str = "tiny", **kw: Any) -> dict:
    d = dict(model_id=model, dtype="float16", kv_layout="NHD", block_tokens=16,
             block_bytes=BLOCK)
    d.update(kw)
    return d


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [(salt * 1000 + i).to_bytes(4, "little") * 8 for i in range(n)]


def data(n: int, seed: int = 0) -> list[bytes]:
    return [bytes([(seed + i) % 251]) * BLOCK for i in range(n)]


@pytest.fixture
def disk_dir() -> Any:
    d = tempfile.mkdtemp(prefix="kvk-disk-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


async def admin(d: Any) -> Any:
    ch = grpc.aio.insecure_channel(f"unix:{d.socket_path}")
    return ch, apb_grpc.KVKeeperAdminStub(ch)


async def expect(code: grpc.StatusCode, coro: Any, fragment: str = "") -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code, info.value.details()
    assert fragment in info.value.details(), info.value.details()
    return info.value.details()


async def test_list_namespaces(daemon: Any) -> None:
    url = f"unix://{daemon.socket_path}"
    a = await AsyncClient.connect(url, ns("model-a", cache_salt="tenant-secret"))
    b1 = await AsyncClient.connect(url, ns("model-b", tp_size=2, tp_rank=1))
    b2 = await AsyncClient.connect(url, ns("model-b", tp_size=2, tp_rank=1))
    daemon.ledger.quotas = {"model-b": 1 << 20}
    ch, stub = await admin(daemon)
    try:
        await a.save(keys(3), data(3))
        resp = await stub.ListNamespaces(apb.ListNamespacesRequest())
        by_model = {n.descriptor.model_id: n for n in resp.namespaces}
        assert sorted(by_model) == ["model-a", "model-b"]
        na, nb = by_model["model-a"], by_model["model-b"]
        assert na.namespace_id == a.namespace_id and na.registered
        assert (na.sessions, nb.sessions) == (1, 2)
        assert [(t.tier, t.blocks, t.bytes) for t in na.tiers] == [(pb.TIER_HOST, 3, 3 * 8192)]
        assert (nb.descriptor.tp_rank, nb.descriptor.tp_size, nb.descriptor.block_bytes) == \
            (1, 2, BLOCK)
        assert na.descriptor.cache_salt == "(set)"      # the salt itself stays inside
        assert not na.HasField("quota_bytes") and nb.quota_bytes == 1 << 20
    finally:
        for c in (a, b1, b2):
            await c.close()
        await ch.close()


async def test_inspect_block(daemon: Any) -> None:
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns())
    ch, stub = await admin(daemon)
    try:
        ks = keys(2)
        await c.save(ks, data(2))
        m = await c.match(ks, lease=True)
        nsid = c.namespace_id
        r = await stub.InspectBlock(apb.InspectBlockRequest(namespace_id=nsid, key=ks[0]))
        (copy,) = r.copies
        assert (copy.tier, copy.state, copy.refs, copy.hits, copy.bytes) == \
            (pb.TIER_HOST, "committed", 1, 1, BLOCK)
        assert copy.idle_seconds >= 0
        assert r.checksum_algo == pb.CHECKSUM_XXH3_64   # the client default
        await c.release(m.lease_id)
        r = await stub.InspectBlock(apb.InspectBlockRequest(namespace_id=nsid, key=ks[0]))
        assert r.copies[0].refs == 0
        await expect(grpc.StatusCode.NOT_FOUND, stub.InspectBlock(
            apb.InspectBlockRequest(namespace_id=nsid, key=keys(1, salt=9)[0])), "no tier holds")
        await expect(grpc.StatusCode.INVALID_ARGUMENT, stub.InspectBlock(
            apb.InspectBlockRequest(namespace_id=nsid[:8], key=ks[0])), "32 hex digits")
        await expect(grpc.StatusCode.INVALID_ARGUMENT, stub.InspectBlock(
            apb.InspectBlockRequest(namespace_id=nsid, key=ks[0][:5])), "64 hex digits")
    finally:
        await c.close()
        await ch.close()


async def test_evict_a_namespace_or_all(daemon: Any) -> None:
    url = f"unix://{daemon.socket_path}"
    a = await AsyncClient.connect(url, ns("model-a"))
    b = await AsyncClient.connect(url, ns("model-b"))
    ch, stub = await admin(daemon)
    try:
        await a.save(keys(4), data(4))
        await b.save(keys(3), data(3))
        m = await a.match(keys(1), lease=True)            # a leased block stays
        r = await stub.Evict(apb.EvictRequest(namespace_id=a.namespace_id))
        assert (r.evicted, r.remaining) == (3, 1)
        assert (await a.match(keys(4))).matched == 1
        assert (await b.match(keys(3))).matched == 3        # the other namespace is untouched
        await a.release(m.lease_id)
        r = await stub.Evict(apb.EvictRequest(all=True))
        assert (r.evicted, r.remaining) == (4, 0)
        assert (await b.match(keys(3))).matched == 0
        daemon.ledger.check_invariants()
        await expect(grpc.StatusCode.NOT_FOUND,
                     stub.Evict(apb.EvictRequest(namespace_id=b"\x01" * 16)), "unknown namespace")
        await expect(grpc.StatusCode.INVALID_ARGUMENT, stub.Evict(apb.EvictRequest()),
                     "name what to evict")
        await expect(grpc.StatusCode.INVALID_ARGUMENT, stub.Evict(apb.EvictRequest(all=False)))
    finally:
        await a.close()
        await b.close()
        await ch.close()


async def test_drain_refuses_saves_and_keeps_serving_loads(daemon: Any) -> None:
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns())
    ch, stub = await admin(daemon)
    try:
        await c.save(keys(2), data(2))
        r = await stub.Drain(apb.DrainRequest())
        assert not r.disk_tier and r.open_reservations == 0
        with pytest.raises(UnavailableError, match="draining"):
            await c.save(keys(2, salt=1), data(2))
        m = await c.match(keys(2), lease=True)
        assert await c.load(m.lease_id) == data(2)
        await stub.Drain(apb.DrainRequest())                # again: still fine
    finally:
        await c.close()
        await ch.close()


async def test_drain_waits_for_write_back(daemon_factory: Any, disk_dir: str) -> None:
    d = await daemon_factory(**{"disk_tier.path": disk_dir, "disk_tier.capacity_bytes": 64 << 20,
                                "disk_tier.write_policy": "write-back"})
    gate = threading.Event()
    real_write = d.disk.store.write

    def held_write(*args: Any) -> int:
        gate.wait(30)
        return real_write(*args)

    d.disk.store.write = held_write  # type: ignore[method-assign]
    c = await AsyncClient.connect(f"unix://{d.socket_path}", ns())
    ch, stub = await admin(d)
    try:
        await c.save(keys(4), data(4))                      # acknowledged, flushes held
        draining = asyncio.ensure_future(stub.Drain(apb.DrainRequest()))
        for _ in range(20):
            await asyncio.sleep(0.01)
        assert not draining.done()                          # a flush cannot finish: no answer
        gate.set()
        r = await draining
        assert r.disk_tier
        entries = list(d.disk.index)
        assert len(entries) == 4 and all(e.state == STORED for e in entries)
    finally:
        gate.set()
        await c.close()
        await ch.close()


async def test_verify_reports_and_quarantines_bad_files(daemon_factory: Any, disk_dir: str) -> None:
    d = await daemon_factory(**{"disk_tier.path": disk_dir, "disk_tier.capacity_bytes": 64 << 20})
    c = await AsyncClient.connect(f"unix://{d.socket_path}", ns())
    ch, stub = await admin(d)
    try:
        ks = keys(5)
        await c.save(ks, data(5))
        with open(d.disk.store.block_path(c.namespace_id, ks[2]), "r+b") as f:
            f.seek(-3, os.SEEK_END)
            f.write(b"\xff\x00\xff")
        msgs = [m async for m in stub.Verify(apb.VerifyRequest())]
        final = msgs[-1]
        assert final.done and not any(m.done for m in msgs[:-1])
        assert msgs[-2].processed == msgs[-2].total == 5        # progress reached the end
        assert (final.checked, final.bad, final.missing, final.quarantined) == (4, 1, 0, 1)
        assert final.bytes == 4 * BLOCK
        assert len(list(Path(disk_dir, "quarantine").iterdir())) == 1
        again = [m async for m in stub.Verify(apb.VerifyRequest())][-1]
        assert (again.checked, again.bad) == (4, 0)
    finally:
        await c.close()
        await ch.close()


async def test_verify_without_a_disk_tier(daemon: Any) -> None:
    ch, stub = await admin(daemon)
    async with ch:
        call = stub.Verify(apb.VerifyRequest())
        await expect(grpc.StatusCode.FAILED_PRECONDITION, call.read(), "no disk tier")


async def test_disk_only_namespaces_are_listed(daemon_factory: Any, disk_dir: str) -> None:
    cfg = {"disk_tier.path": disk_dir, "disk_tier.capacity_bytes": 64 << 20}
    a = await daemon_factory(**cfg)
    c = await AsyncClient.connect(f"unix://{a.socket_path}", ns())
    await c.save(keys(3), data(3))
    nsid = c.namespace_id
    await c.close()
    await a.stop(0)
    b = await daemon_factory(**cfg)
    ch, stub = await admin(b)
    async with ch:
        (n,) = (await stub.ListNamespaces(apb.ListNamespacesRequest())).namespaces
        assert (n.namespace_id, n.registered, n.descriptor.model_id) == (nsid, False, "")
        assert [(t.tier, t.blocks, t.bytes) for t in n.tiers] == [(pb.TIER_DISK, 3, 3 * BLOCK)]
        r = await stub.InspectBlock(apb.InspectBlockRequest(namespace_id=nsid, key=keys(1)[0]))
        assert [(x.tier, x.state, x.idle_seconds) for x in r.copies] == \
            [(pb.TIER_DISK, STORED, -1.0)]


async def test_admin_disabled_is_unimplemented(daemon_factory: Any) -> None:
    d = await daemon_factory(**{"admin.enabled": False})
    ch, stub = await admin(d)
    async with ch:
        await expect(grpc.StatusCode.UNIMPLEMENTED, stub.ListNamespaces(apb.ListNamespacesRequest()))
        await expect(grpc.StatusCode.UNIMPLEMENTED, stub.Evict(apb.EvictRequest(all=True)))
    c = await AsyncClient.connect(f"unix://{d.socket_path}", ns())   # the data service is on
    await c.close()
