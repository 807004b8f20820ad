"""Match(lease, blocks) on the wire: the refs are exactly what a Load of the same
lease returns, blocks without a lease is ignored, and a bad request changes
nothing. Raw stubs, so what is checked is what travels."""
from __future__ import annotations

import zlib
from typing import Any

import grpc

# The wire tests' helpers; BLOCK is four pages, the last one partial, so a
# block has several extents.
from test_servicer_errors import BLOCK, descriptor, expect, key, snapshot

from kvkeeper.v1 import kvkeeper_pb2 as pb


def data(i: int) -> bytes:
    return bytes((i * 31 + j) % 251 for j in range(BLOCK))


async def saved(stub: Any, n: int) -> tuple[str, list[bytes]]:
    """A session with blocks key(0..n-1) committed (streamed, CRC32 given)."""
    r = await stub.RegisterSession(pb.RegisterSessionRequest(instance_id="t", namespace=descriptor()))
    sid = r.session_id
    ks = [key(i) for i in range(n)]
    res = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=ks,
                                                       transport=pb.TRANSPORT_STREAM))
    await stub.WriteBlocks(iter([pb.WriteChunk(session_id=sid, reservation_id=res.reservation_id,
                                               index=i, data=data(i)) for i in range(n)]))
    await stub.CommitSave(pb.CommitSaveRequest(
        session_id=sid, reservation_id=res.reservation_id, checksum_algo=pb.CHECKSUM_CRC32,
        checksums=[zlib.crc32(data(i)) for i in range(n)]))
    return sid, ks


def load_shm_bytes(daemon: Any) -> float:
    return daemon.metrics.registry.get_sample_value(
        "kvkeeper_transfer_bytes_total", {"direction": "load", "transport": "shm"})


async def test_match_blocks_equal_a_load_of_the_same_lease(daemon: Any, stub: Any) -> None:
    sid, ks = await saved(stub, 3)
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=ks + [key(99)], lease=True,
                                         blocks=True))
    assert m.matched == 3 and m.lease_id
    assert [r.key for r in m.blocks] == ks
    assert load_shm_bytes(daemon) == 3 * BLOCK  # counted where the refs are handed out
    loaded = await stub.Load(pb.LoadRequest(session_id=sid, lease_id=m.lease_id))
    assert list(m.blocks) == list(loaded.blocks)  # keys, extents, checksums
    for i, ref in enumerate(m.blocks):
        assert ref.checksum_algo == pb.CHECKSUM_CRC32 and ref.checksum == zlib.crc32(data(i))
        assert daemon.arena.read(ref.extents) == data(i)
    await stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=m.lease_id))
    daemon.ledger.check_invariants()


async def test_blocks_are_only_sent_when_asked_for_with_a_lease(daemon: Any, stub: Any) -> None:
    sid, ks = await saved(stub, 2)
    before = snapshot(daemon)
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=ks, blocks=True))
    assert m.matched == 2 and not m.lease_id and not m.blocks
    assert snapshot(daemon) == before  # no lease taken, no pin
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=ks, lease=True))
    assert m.lease_id and not m.blocks
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=[key(50)], lease=True, blocks=True))
    assert m.matched == 0 and not m.lease_id and not m.blocks
    assert load_shm_bytes(daemon) == 0


async def test_a_bad_match_with_blocks_changes_nothing(daemon: Any, stub: Any) -> None:
    sid, ks = await saved(stub, 2)
    before = snapshot(daemon)
    await expect(grpc.StatusCode.INVALID_ARGUMENT,
                 stub.Match(pb.MatchRequest(session_id=sid, keys=[ks[0], b"short"], lease=True,
                                            blocks=True)),
                 "every key must be 32 bytes")
    await expect(grpc.StatusCode.NOT_FOUND,
                 stub.Match(pb.MatchRequest(session_id="nope", keys=ks, lease=True, blocks=True)),
                 "RegisterSession first")
    assert snapshot(daemon) == before
    assert load_shm_bytes(daemon) == 0
