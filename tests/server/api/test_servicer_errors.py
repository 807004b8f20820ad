"""Every bad input gets its own status code and message, the ledger is unchanged,
and the daemon keeps serving. Raw stubs, so the codes on the wire are checked."""
from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

BLOCK = 3 * 4096 + 100  # four pages, the last one partial


def descriptor(**kw: Any) -> pb.NamespaceDescriptor:
    d = dict(model_id="tiny-llama", dtype="float16", kv_layout="NHD",
             block_tokens=32, block_bytes=BLOCK, tp_rank=0, tp_size=1)
    d.update(kw)
    return pb.NamespaceDescriptor(**d)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


async def register(stub: Any, **kw: Any) -> str:
    r = await stub.RegisterSession(pb.RegisterSessionRequest(instance_id="t", namespace=descriptor(**kw)))
    return r.session_id


def snapshot(daemon: Any) -> tuple:
    L = daemon.ledger
    L.check_invariants()
    t = L.top
    blocks = sorted((ns.id, k, b.state.value, b.refs) for ns in L.namespaces.values()
                    for k, b in ns.blocks.items())
    return (tuple(blocks), t.used_pages, t.evictable_pages, len(L.leases), len(L.reservations),
            len(L.sessions))


async def expect(code: grpc.StatusCode, coro: Any, fragment: str) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await coro
    assert info.value.code() == code, info.value.details()
    assert fragment in info.value.details(), info.value.details()
    return info.value.details()


async def test_bad_inputs_each_get_their_status_and_leave_state_unchanged(daemon: Any, stub: Any) -> None:
    sid = await register(stub)
    r = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=[key(1), key(2)],
                                                     transport=pb.TRANSPORT_STREAM))
    before = snapshot(daemon)
    cases = [
        (grpc.StatusCode.INVALID_ARGUMENT, stub.Match(pb.MatchRequest(session_id=sid, keys=[b"short"])),
         "every key must be 32 bytes"),
        (grpc.StatusCode.INVALID_ARGUMENT, stub.Match(pb.MatchRequest(session_id=sid, keys=[b"x" * 4096])),
         "every key must be 32 bytes"),
        (grpc.StatusCode.INVALID_ARGUMENT,
         stub.Match(pb.MatchRequest(session_id=sid, keys=[key(0)] * 5000)), "split the call"),
        (grpc.StatusCode.INVALID_ARGUMENT,
         stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=[key(9), key(9)])), "appears twice"),
        (grpc.StatusCode.NOT_FOUND, stub.Match(pb.MatchRequest(session_id="nope", keys=[key(1)])),
         "RegisterSession first"),
        (grpc.StatusCode.NOT_FOUND, stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=777)),
         "unknown lease"),
        (grpc.StatusCode.NOT_FOUND, stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=999)),
         "call ReserveSave first"),
        (grpc.StatusCode.INVALID_ARGUMENT,
         stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=r.reservation_id,
                                              checksums=[1, 2, 3])), "one per key"),
        (grpc.StatusCode.FAILED_PRECONDITION,
         stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=r.reservation_id)),
         "received 0 of"),
        (grpc.StatusCode.INVALID_ARGUMENT,
         stub.RegisterSession(pb.RegisterSessionRequest(namespace=descriptor(model_id=""))), "model_id"),
        (grpc.StatusCode.INVALID_ARGUMENT,
         stub.RegisterSession(pb.RegisterSessionRequest(namespace=descriptor(block_bytes=0))), "block_bytes"),
        (grpc.StatusCode.INVALID_ARGUMENT,
         stub.RegisterSession(pb.RegisterSessionRequest(namespace=descriptor(tp_rank=2, tp_size=2))),
         "tp_rank"),
        (grpc.StatusCode.INVALID_ARGUMENT,
         stub.RegisterSession(pb.RegisterSessionRequest(namespace=descriptor(block_bytes=1 << 30))),
         "does not fit"),
    ]
    for code, call, fragment in cases:
        await expect(code, call, fragment)
        assert snapshot(daemon) == before, fragment
    # Still serving.
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=[key(1)]))
    assert m.matched == 0


async def test_streamed_write_errors(daemon: Any, stub: Any) -> None:
    sid = await register(stub)
    r = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=[key(1)],
                                                     transport=pb.TRANSPORT_STREAM))

    async def write(*chunks: pb.WriteChunk) -> Any:
        return await stub.WriteBlocks(iter(chunks))

    first = dict(session_id=sid, reservation_id=r.reservation_id)
    await expect(grpc.StatusCode.OUT_OF_RANGE,
                 write(pb.WriteChunk(**first, index=0, offset=0, data=b"x" * (BLOCK + 1))), "past the block size")
    await expect(grpc.StatusCode.INVALID_ARGUMENT,
                 write(pb.WriteChunk(**first, index=3, offset=0, data=b"x")), "was not reserved")
    await expect(grpc.StatusCode.INVALID_ARGUMENT,
                 write(pb.WriteChunk(**first, index=0, offset=10, data=b"x")), "in order")
    await expect(grpc.StatusCode.NOT_FOUND,
                 write(pb.WriteChunk(session_id=sid, reservation_id=4242, index=0, data=b"x")),
                 "unknown reservation")
    # A complete write then commits.
    ok = await write(pb.WriteChunk(**first, index=0, offset=0, data=b"a" * 5000),
                     pb.WriteChunk(index=0, offset=5000, data=b"b" * (BLOCK - 5000)))
    assert ok.bytes_written == BLOCK
    c = await stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=r.reservation_id))
    assert c.committed == 1
    await expect(grpc.StatusCode.FAILED_PRECONDITION,
                 stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=r.reservation_id)),
                 "no longer open")


async def test_double_release_and_foreign_lease(daemon: Any, stub: Any) -> None:
    a = await register(stub)
    b = await register(stub)
    r = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=a, keys=[key(5)]))
    await stub.CommitSave(pb.CommitSaveRequest(session_id=a, reservation_id=r.reservation_id))
    m = await stub.Match(pb.MatchRequest(session_id=a, keys=[key(5)], lease=True))
    assert m.matched == 1 and m.lease_id
    await expect(grpc.StatusCode.FAILED_PRECONDITION,
                 stub.Release(pb.ReleaseRequest(session_id=b, lease_id=m.lease_id)), "another session")
    await stub.Release(pb.ReleaseRequest(session_id=a, lease_id=m.lease_id))
    before = snapshot(daemon)
    await expect(grpc.StatusCode.FAILED_PRECONDITION,
                 stub.Release(pb.ReleaseRequest(session_id=a, lease_id=m.lease_id)), "already released")
    assert snapshot(daemon) == before
    blk = next(iter(daemon.ledger.namespaces.values())).blocks[key(5)]
    assert blk.refs == 0


async def test_capacity_exhausted_is_atomic(daemon: Any, stub: Any) -> None:
    sid = await register(stub)
    keys = [key(i) for i in range(16)]  # 16 blocks x 4 pages = all 64 pages
    r = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=keys))
    assert all(s.status == pb.SLOT_RESERVED for s in r.slots)
    before = snapshot(daemon)
    await expect(grpc.StatusCode.RESOURCE_EXHAUSTED,
                 stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=[key(100)])),
                 "queue, preempt or skip")
    assert snapshot(daemon) == before
    await stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=r.reservation_id))
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=keys[:2], lease=True))
    # With two blocks leased, 14 are evictable: a save of 15 must fail whole...
    before = snapshot(daemon)
    await expect(grpc.StatusCode.RESOURCE_EXHAUSTED,
                 stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=[key(200 + i) for i in range(15)])),
                 "pinned")
    assert snapshot(daemon) == before
    # ...and a save of 14 evicts exactly the unleased ones.
    r2 = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=[key(200 + i) for i in range(14)]))
    assert r2.reservation_id
    m2 = await stub.Match(pb.MatchRequest(session_id=sid, keys=keys[:2]))
    assert m2.matched == 2
    await stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=m.lease_id))
    daemon.ledger.check_invariants()


async def test_expired_session_is_told_to_register_again(daemon_factory: Any) -> None:
    import asyncio
    d = await daemon_factory(**{"ledger.lease_ttl_seconds": 0.2})
    async with grpc.aio.insecure_channel(f"unix:{d.socket_path}") as ch:
        stub = pb_grpc.KVKeeperStub(ch)
        sid = await register(stub)
        r = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=[key(1)]))
        assert d.ledger.top.used_pages == 4
        await asyncio.sleep(0.4)
        await expect(grpc.StatusCode.FAILED_PRECONDITION,
                     stub.Match(pb.MatchRequest(session_id=sid, keys=[key(1)])), "RegisterSession again")
        # Its reservation went with it (its pages cool a while: cooling.py).
        ns_id = next(iter(d.ledger.namespaces))
        assert not d.ledger.reservations and d.ledger.block(ns_id, key(1)) is None
        assert d.ledger.top.used_pages == d.ledger.top.cooling.pages == 4
        await expect(grpc.StatusCode.FAILED_PRECONDITION,
                     stub.Heartbeat(pb.HeartbeatRequest(session_id=sid)), "expired or was closed")
        assert r.reservation_id
