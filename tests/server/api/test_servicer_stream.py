"""LoadStream and WriteBlocks on the wire, with the daemon's hand-built
frames (kvkeeper.client.wire): what the generated protobuf stub receives and
sends must be exactly the messages the proto describes."""
from __future__ import annotations

import zlib
from typing import Any

import pytest
from test_servicer_errors import BLOCK, descriptor, key, register
from test_servicer_match_blocks import data, saved

from kvkeeper.v1 import kvkeeper_pb2 as pb


@pytest.mark.parametrize("chunk", [1 << 20, 5000, 4096])
async def test_load_stream_sends_protobuf_chunks_of_the_saved_bytes(
        daemon: Any, stub: Any, chunk: int) -> None:
    # Blocks span four pages (several extents); chunks of 5000 bytes cross them.
    daemon.servicer.stream_chunk_bytes = chunk
    sid, ks = await saved(stub, 3)
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=ks, lease=True))
    got: dict = {}
    async for ch in stub.LoadStream(pb.LoadRequest(session_id=sid, lease_id=m.lease_id)):
        assert isinstance(ch, pb.BlockChunk)
        first = ch.offset == 0
        assert ch.checksum_algo == (pb.CHECKSUM_CRC32 if first else pb.CHECKSUM_NONE)
        assert ch.checksum == (zlib.crc32(data(ch.index)) if first else 0)
        assert len(ch.data) == min(chunk, BLOCK - ch.offset)
        got.setdefault(ch.index, []).append((ch.offset, ch.data))
    assert sorted(got) == [0, 1, 2]
    for i, parts in got.items():
        assert [o for o, _ in parts] == list(range(0, BLOCK, chunk))
        assert b"".join(d for _, d in parts) == data(i)
    await stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=m.lease_id))
    daemon.ledger.check_invariants()


async def test_write_blocks_reads_protobuf_chunks_with_unknown_fields(daemon: Any,
                                                                      stub: Any) -> None:
    """The daemon's WriteChunk parser skips fields it does not know, as protobuf does."""
    sid = await register(stub)
    k = (7).to_bytes(4, "little") * 8
    res = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=[k],
                                                       transport=pb.TRANSPORT_STREAM))
    body = bytes(range(256)) * (BLOCK // 256) + bytes(BLOCK % 256)
    msgs = [pb.WriteChunk(session_id=sid, reservation_id=res.reservation_id, index=0,
                          data=body[:5000]),
            pb.WriteChunk(index=0, offset=5000, data=body[5000:])]
    # field 99, length-delimited: unknown to this proto version
    raw = [m.SerializeToString() + b"\x9a\x06\x03abc" for m in msgs]
    # protobuf keeps unknown fields when it parses and sends them on
    resp = await stub.WriteBlocks(iter([pb.WriteChunk.FromString(r) for r in raw]))
    assert resp.bytes_written == BLOCK
    await stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=res.reservation_id))
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=[k], lease=True, blocks=True))
    assert daemon.arena.read(m.blocks[0].extents) == body


async def test_a_lease_released_mid_stream_ends_it_with_failed_precondition(
        daemon_factory: Any) -> None:
    """Every frame is built while the lease is live: once it is released, the
    next block is refused instead of read from pages that may be reused."""
    import grpc

    from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

    big = 1 << 20    # 24 MiB in all: far more than the stream can have in flight
    d = await daemon_factory(**{"host_tier.capacity_bytes": 4096 + 32 * big})
    async with grpc.aio.insecure_channel(f"unix:{d.socket_path}") as ch:
        stub = pb_grpc.KVKeeperStub(ch)
        r = await stub.RegisterSession(pb.RegisterSessionRequest(
            instance_id="t", namespace=descriptor(block_bytes=big)))
        sid, ks = r.session_id, [key(i) for i in range(24)]
        res = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=ks,
                                                           transport=pb.TRANSPORT_STREAM))
        await stub.WriteBlocks(iter([pb.WriteChunk(session_id=sid, reservation_id=res.reservation_id,
                                                   index=i, data=bytes([i]) * big)
                                     for i in range(24)]))
        await stub.CommitSave(pb.CommitSaveRequest(session_id=sid,
                                                   reservation_id=res.reservation_id))
        m = await stub.Match(pb.MatchRequest(session_id=sid, keys=ks, lease=True))
        call = stub.LoadStream(pb.LoadRequest(session_id=sid, lease_id=m.lease_id))
        first = await call.read()
        assert first.index == 0 and first.data == bytes([0]) * big
        await stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=m.lease_id))
        got = 1
        with pytest.raises(grpc.aio.AioRpcError) as info:
            while (c := await call.read()) is not grpc.aio.EOF:
                assert c.data == bytes([c.index]) * len(c.data)   # never another block's bytes
                got += 1
        assert info.value.code() == grpc.StatusCode.FAILED_PRECONDITION
        assert "released while it was being streamed" in info.value.details()
        assert got < 24
    d.ledger.check_invariants()
