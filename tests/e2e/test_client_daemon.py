"""The client library against a real daemon: both data paths, checksums, leases."""
from __future__ import annotations

import asyncio
import os
from typing import Any

import grpc
import numpy as np
import pytest

from kvkeeper.client import (AsyncClient, ChecksumError, Client, FailedPreconditionError,
                             KVKeeperClientError)
from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

BLOCK = 3 * 4096 + 100


def ns(**kw: Any) -> dict:
    d = dict(model_id="tiny", dtype="float16", kv_layout="NHD", block_tokens=32, block_bytes=BLOCK)
    d.update(kw)
    return d


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [(salt * 1000 + i).to_bytes(4, "little") * 8 for i in range(n)]


def blocks(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(n)]


@pytest.mark.parametrize("writer,reader", [("shm", "shm"), ("stream", "stream"), ("shm", "stream"),
                                           ("stream", "shm")])
async def test_save_then_load_across_transports(daemon: Any, writer: str, reader: str) -> None:
    url = f"unix://{daemon.socket_path}"
    w = await AsyncClient.connect(url, ns(), transport=writer)
    r = await AsyncClient.connect(url, ns(), transport=reader)
    try:
        assert w.transport == writer and r.transport == reader
        ks, bs = keys(4), blocks(4)
        saved = await w.save(ks, bs)
        assert saved.committed == 4
        again = await w.save(ks, bs)
        assert again.present == 4 and again.committed == 0
        m = await r.match(ks + keys(2, salt=9), lease=True)
        assert m.matched == 4 and m.lease_id
        assert all(t == pb.TIER_HOST for t in m.tiers)
        assert await r.load(m.lease_id) == bs
        outs = [bytearray(BLOCK) for _ in range(4)]
        await r.load_into(m.lease_id, outs)
        assert [bytes(o) for o in outs] == bs
        await r.release(m.lease_id)
        daemon.ledger.check_invariants()
    finally:
        await w.close()
        await r.close()


async def test_tcp_client_streams(daemon: Any) -> None:
    c = await AsyncClient.connect(f"127.0.0.1:{daemon.port}", ns())
    try:
        # Over TCP the arena is still mappable on this host: auto prefers shm.
        assert c.transport == "shm"
        await c.save(keys(2), blocks(2))
    finally:
        await c.close()


async def test_namespaces_are_isolated(daemon: Any) -> None:
    url = f"unix://{daemon.socket_path}"
    a = await AsyncClient.connect(url, ns())
    b = await AsyncClient.connect(url, ns(cache_salt="tenant-b"))
    try:
        await a.save(keys(3), blocks(3))
        assert (await b.match(keys(3))).matched == 0
        assert (await a.match(keys(3))).matched == 3
    finally:
        await a.close()
        await b.close()


async def test_corrupted_block_is_reported_not_served(daemon: Any) -> None:
    url = f"unix://{daemon.socket_path}"
    c = await AsyncClient.connect(url, ns(), checksum="crc32")
    try:
        ks, bs = keys(3), blocks(3)
        await c.save(ks, bs)
        blk = daemon.ledger.block(c.namespace_id, ks[1])
        off, _ = daemon.arena.extents(blk.pages, blk.ns.pages_per_block, BLOCK)[0]
        with open(daemon.arena.path, "r+b") as f:
            f.seek(off + 17)
            byte = f.read(1)
            f.seek(off + 17)
            f.write(bytes([byte[0] ^ 0xFF]))
        m = await c.match(ks, lease=True)
        with pytest.raises(ChecksumError) as info:
            await c.load(m.lease_id)
        assert info.value.bad_indices == [1]
        await c.release(m.lease_id, discard_indices=info.value.bad_indices)
        # The bad block was dropped; the chain now breaks at it.
        assert (await c.match(ks)).matched == 1
        assert daemon.ledger.block(c.namespace_id, ks[2]) is not None
        daemon.ledger.check_invariants()
    finally:
        await c.close()


async def test_copies_in_shards_through_the_daemon(daemon: Any, monkeypatch: Any) -> None:
    """copy_threads: a batch copied by several threads saves the same
    checksums and names a corrupted block by its place in the lease."""
    from kvkeeper.client import copies

    monkeypatch.setattr(copies, "SHARD_MIN_BYTES", BLOCK)
    url = f"unix://{daemon.socket_path}"
    for bad in (-1, 1.5, "2", True):
        with pytest.raises(ValueError, match="copy_threads"):
            await AsyncClient.connect(url, ns(), copy_threads=bad)
    c = await AsyncClient.connect(url, ns(), transport="shm", copy_threads=3)
    try:
        ks, bs = keys(7), blocks(7, seed=4)
        assert (await c.save(ks, bs)).committed == 7
        blk = daemon.ledger.block(c.namespace_id, ks[5])
        off, _ = daemon.arena.extents(blk.pages, blk.ns.pages_per_block, BLOCK)[0]
        daemon.arena.view(off + BLOCK - 1, 1)[0] ^= 0x40
        m = await c.match(ks, lease=True)
        outs = [bytearray(BLOCK) for _ in range(7)]
        with pytest.raises(ChecksumError) as info:
            await c.load_into(m.lease_id, outs)
        assert info.value.bad_indices == [5]
        assert [bytes(o) for i, o in enumerate(outs) if i != 5] == bs[:5] + bs[6:]
        await c.release(m.lease_id)
    finally:
        await c.close()


async def test_closed_session_releases_its_leases(daemon: Any) -> None:
    url = f"unix://{daemon.socket_path}"
    c = await AsyncClient.connect(url, ns())
    await c.save(keys(2), blocks(2))
    m = await c.match(keys(2), lease=True)
    assert daemon.ledger.top.evictable_pages == 0
    await c.close()
    assert not daemon.ledger.leases
    assert daemon.ledger.top.evictable_pages == daemon.ledger.top.used_pages
    daemon.ledger.check_invariants()
    assert m.lease_id


async def test_double_release_is_an_error(daemon: Any) -> None:
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns())
    try:
        await c.save(keys(1), blocks(1))
        m = await c.match(keys(1), lease=True)
        await c.release(m.lease_id)
        with pytest.raises(FailedPreconditionError):
            await c.release(m.lease_id)
        assert daemon.ledger.block(c.namespace_id, keys(1)[0]).refs == 0
    finally:
        await c.close()


async def test_metrics_follow_traffic(daemon: Any) -> None:
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns())
    try:
        await c.save(keys(2), blocks(2))
        await c.match(keys(3))
        text = daemon.metrics.render().decode()
        assert 'kvkeeper_hit_blocks_total{tier="host"} 2.0' in text
        assert 'kvkeeper_rpc_duration_seconds_count{method="Match"} 1.0' in text
    finally:
        await c.close()
    assert os.path.exists(daemon.arena.path)


async def test_match_with_blocks_gives_zero_copy_views(daemon: Any) -> None:
    url = f"unix://{daemon.socket_path}"
    w = await AsyncClient.connect(url, ns(), transport="stream")
    c = await AsyncClient.connect(url, ns(), transport="shm")
    try:
        ks, bs = keys(3), blocks(3)
        await w.save(ks, bs)
        with pytest.raises(ValueError, match="lease=True"):
            await c.match(ks, blocks=True)
        assert not daemon.ledger.leases
        m = await c.match(ks + keys(1, salt=7), lease=True, blocks=True)
        assert m.matched == 3 and m.lease_id and [r.key for r in m.blocks] == ks
        views = c.arena_views(m.blocks)
        assert views is not None and len(views) == 3
        assert [b"".join(vs) for vs in views] == bs
        assert all(v.readonly for vs in views for v in vs)
        # The refs are what Load hands out: load_into through them agrees.
        outs = [bytearray(BLOCK) for _ in range(3)]
        await c.load_into(m.lease_id, outs)
        assert [bytes(o) for o in outs] == bs
        await c.release(m.lease_id)
        assert (await c.match(ks, lease=True)).blocks == []  # not asked for
        daemon.ledger.check_invariants()

        # A streaming client does not ask for refs it could not use: no views, load_into streams.
        m = await w.match(ks, lease=True, blocks=True)
        assert m.matched == 3 and m.blocks == []
        assert w.arena_views(m.blocks) is None
        ref = pb.BlockRef(key=ks[0], extents=[pb.Extent(offset=4096, length=BLOCK)])
        assert w.arena_views([ref]) is None
        await w.release(m.lease_id)
    finally:
        await w.close()
        await c.close()


async def test_arena_views_check_the_refs_and_outlive_close(daemon: Any) -> None:
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns(), transport="shm")
    await c.save(keys(1), blocks(1))
    m = await c.match(keys(1), lease=True, blocks=True)
    short = pb.BlockRef(key=keys(1)[0], extents=[pb.Extent(offset=4096, length=BLOCK - 1)])
    with pytest.raises(KVKeeperClientError, match="spans"):
        c.arena_views([short])
    outside = pb.BlockRef(key=keys(1)[0], extents=[pb.Extent(offset=0, length=BLOCK)])
    with pytest.raises(KVKeeperClientError, match="outside the arena"):
        c.arena_views([outside])
    [views] = c.arena_views(m.blocks)
    await c.close()
    assert c.arena_views(m.blocks) is None
    # Still mapped while the views live (the daemon released the lease with the session,
    # but nothing reused the pages yet).
    assert b"".join(views) == blocks(1)[0]


async def test_blocking_client_match_with_blocks(daemon: Any) -> None:
    def run() -> None:  # in a thread: the daemon serves on this test's event loop
        with Client.connect(f"unix://{daemon.socket_path}", ns(), transport="shm") as c:
            ks, bs = keys(2, salt=3), blocks(2, seed=3)
            c.save(ks, bs)
            m = c.match(ks, lease=True, blocks=True)
            views = c.arena_views(m.blocks)
            assert views is not None and [b"".join(vs) for vs in views] == bs
            with pytest.raises(ValueError, match="lease=True"):
                c.match(ks, blocks=True)
            c.release(m.lease_id)

    await asyncio.to_thread(run)


async def test_report_use_narrow_and_report_through_the_client(daemon: Any) -> None:
    """The connector's way of looking up: Match(report_use) counts no hit, narrow()
    unpins what the client holds itself, release(report=) counts what it loaded."""
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns())
    try:
        await c.save(keys(4), blocks(4))
        m = await c.match(keys(5), lease=True, blocks=True, report_use=True)
        assert m.matched == 4 and len(m.blocks) == 4
        assert daemon.ledger.top.hit_tokens == 0
        await c.narrow(m.lease_id, 1, 3)
        assert [len(lease.blocks) for lease in daemon.ledger.leases.values()] == [3]
        await c.release(m.lease_id, report={"prompt_tokens": 170, "prompt_blocks": 5,
                                            "local_blocks": 1, "loaded_blocks": 3})
        await c.release(0, report={"prompt_tokens": 40, "prompt_blocks": 1, "local_blocks": 0,
                                   "loaded_blocks": 0})
        st = await c.stats()
        assert (st.hit_tokens, st.lookup_tokens, st.prompt_tokens) == (3 * 32, 5 * 32, 210)
        assert not daemon.ledger.leases
        daemon.ledger.check_invariants()
    finally:
        await c.close()


async def test_a_last_turns_release_through_both_clients(daemon: Any) -> None:
    """release(last_turn=True), async and blocking: the daemon demotes the blocks
    the lease held that nobody else pins, counts them, and serves them until
    they are evicted; narrowing a lease cannot carry it."""
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns())
    try:
        await c.save(keys(4), blocks(4))
        m = await c.match(keys(4), lease=True)
        await c.release(m.lease_id, last_turn=True)
        assert daemon.ledger.top.last_turn_demoted == 4
        order = [b.key for b in daemon.ledger.top.policy]
        assert order[:4] == keys(4)[::-1]            # tail first, before anything else
        m = await c.match(keys(4), lease=True)
        assert m.matched == 4                        # demoted, not dropped: still served
        await c.release(m.lease_id)
        text = daemon.metrics.render().decode()
        assert 'kvkeeper_last_turn_blocks_total{tier="host"} 4.0' in text
    finally:
        await c.close()
    s = await asyncio.to_thread(Client.connect, f"unix://{daemon.socket_path}", ns())
    try:
        m = await asyncio.to_thread(s.match, keys(2, salt=1), True)
        assert m.matched == 0
        await asyncio.to_thread(s.save, keys(2, salt=1), blocks(2, seed=1))
        m = await asyncio.to_thread(s.match, keys(2, salt=1), True)
        await asyncio.to_thread(s.release, m.lease_id, False, (), None, True)
        deadline = asyncio.get_running_loop().time() + 5
        while daemon.ledger.top.last_turn_demoted < 6:
            assert asyncio.get_running_loop().time() < deadline
            await asyncio.sleep(0.01)
    finally:
        await asyncio.to_thread(s.close)
    daemon.ledger.check_invariants()


async def test_last_turn_with_keep_blocks_is_refused_and_keeps_the_lease(daemon: Any) -> None:
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns())
    try:
        await c.save(keys(3), blocks(3))
        m = await c.match(keys(3), lease=True)
        async with grpc.aio.insecure_channel(f"unix://{daemon.socket_path}") as ch:
            with pytest.raises(grpc.aio.AioRpcError) as info:   # a Release the client never sends
                await pb_grpc.KVKeeperStub(ch).Release(pb.ReleaseRequest(
                    session_id=c.session_id, lease_id=m.lease_id, keep_start=0, keep_blocks=1,
                    last_turn=True))
        assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "last_turn" in (info.value.details() or "")
        assert len(daemon.ledger.leases) == 1 and daemon.ledger.top.last_turn_demoted == 0
        await c.release(m.lease_id)
    finally:
        await c.close()


async def test_a_client_closed_at_once_leaves_no_thread_dying(daemon: Any,
                                                             monkeypatch: Any) -> None:
    """Connect warms the blocking channel up; a client closed right after
    must not leave a thread that dies on the closed channel (grpc's
    connectivity poller, once: "Cannot monitor channel state: Channel
    closed!" printed to an engine's stderr at each short-lived client)."""
    import threading

    died: list[str] = []
    monkeypatch.setattr(threading, "excepthook",
                        lambda args: died.append(f"{args.exc_type.__name__}: {args.exc_value}"))

    def churn() -> None:
        for _ in range(5):
            Client.connect(f"unix://{daemon.socket_path}", ns()).close()

    await asyncio.to_thread(churn)
    await asyncio.sleep(0.5)   # a poller would die within 0.2 s of its close
    assert died == []
