"""LoadStream with pack_blocks: several whole blocks per chunk, each with its
checksum in BlockChunk.checksums, as the generated protobuf stub reads them;
runs broken where a block's checksum algorithm differs or it does not fit."""
from __future__ import annotations

import zlib
from typing import Any, List

from test_servicer_errors import BLOCK, key, register
from test_servicer_match_blocks import data, saved

from kvkeeper.v1 import kvkeeper_pb2 as pb


async def _chunks(stub: Any, sid: str, keys: List[bytes], pack: bool) -> List[pb.BlockChunk]:
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=keys, lease=True))
    out = [c async for c in stub.LoadStream(pb.LoadRequest(session_id=sid, lease_id=m.lease_id,
                                                           pack_blocks=pack))]
    await stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=m.lease_id))
    return out


async def test_packed_chunks_hold_whole_blocks_with_their_checksums(daemon: Any,
                                                                    stub: Any) -> None:
    daemon.servicer.stream_pack_bytes = 3 * BLOCK + 100   # three blocks fit, four do not
    sid, ks = await saved(stub, 7)
    chunks = await _chunks(stub, sid, ks, pack=True)
    # The first alone, then two, then as many as fit.
    assert [(c.index, c.offset, len(c.data)) for c in chunks] == \
        [(0, 0, BLOCK), (1, 0, 2 * BLOCK), (3, 0, 3 * BLOCK), (6, 0, BLOCK)]
    for c in chunks[1:3]:
        k = len(c.data) // BLOCK
        assert c.checksum_algo == pb.CHECKSUM_CRC32 and c.checksum == 0
        assert list(c.checksums) == [zlib.crc32(data(c.index + j)) for j in range(k)]
        assert c.data == b"".join(data(c.index + j) for j in range(k))
    for c in (chunks[0], chunks[3]):   # alone: ordinary chunks
        assert not c.checksums and c.checksum == zlib.crc32(data(c.index))
        assert c.data == data(c.index)
    daemon.ledger.check_invariants()


async def test_without_pack_blocks_every_chunk_holds_one_block(daemon: Any, stub: Any) -> None:
    daemon.servicer.stream_pack_bytes = 4 * BLOCK
    sid, ks = await saved(stub, 3)
    chunks = await _chunks(stub, sid, ks, pack=False)
    assert [(c.index, len(c.data), len(c.checksums)) for c in chunks] == \
        [(i, BLOCK, 0) for i in range(3)]


async def test_blocks_larger_than_a_chunk_stream_in_pieces_when_packing(daemon: Any,
                                                                        stub: Any) -> None:
    daemon.servicer.stream_chunk_bytes = daemon.servicer.stream_pack_bytes = 5000
    sid, ks = await saved(stub, 2)
    chunks = await _chunks(stub, sid, ks, pack=True)
    assert not any(c.checksums for c in chunks)
    for i in range(2):
        mine = [c for c in chunks if c.index == i]
        assert [c.offset for c in mine] == list(range(0, BLOCK, 5000))
        assert b"".join(c.data for c in mine) == data(i)


async def test_a_block_with_another_checksum_algorithm_starts_a_new_chunk(daemon: Any,
                                                                         stub: Any) -> None:
    daemon.servicer.stream_pack_bytes = 8 * BLOCK
    sid, ks = await saved(stub, 3)                  # CRC32
    more = [key(i) for i in range(3, 5)]            # committed without checksums
    res = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=more,
                                                       transport=pb.TRANSPORT_STREAM))
    await stub.WriteBlocks(iter([pb.WriteChunk(session_id=sid, reservation_id=res.reservation_id,
                                               index=j, data=data(3 + j)) for j in range(2)]))
    await stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=res.reservation_id))
    chunks = await _chunks(stub, sid, ks + more, pack=True)
    assert [(c.index, len(c.data), c.checksum_algo, list(c.checksums)) for c in chunks] == [
        (0, BLOCK, pb.CHECKSUM_CRC32, []),
        (1, 2 * BLOCK, pb.CHECKSUM_CRC32, [zlib.crc32(data(1)), zlib.crc32(data(2))]),
        (3, 2 * BLOCK, pb.CHECKSUM_NONE, [0, 0])]
    assert b"".join(c.data for c in chunks) == b"".join(data(i) for i in range(5))


async def test_packed_chunks_of_tiny_blocks_keep_their_checksums_within_the_margin(
        daemon_factory: Any) -> None:
    """At most MAX_PACK_BLOCKS blocks per chunk, so that their checksums (up
    to ten bytes each) fit the margin under the message limit that the data
    budget leaves: 300 blocks of 12 bytes, all fitting the budget, still go
    in more than one chunk."""
    import grpc

    from kvkeeper.server.api.chunks import CHUNK_OVERHEAD_BYTES, MAX_PACK_BLOCKS
    from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

    tiny, n = 12, 1 + 2 + 4 + 8 + 16 + 32 + 64 + 128 + 256 + 9   # ramped up to the cap
    d = await daemon_factory(**{"host_tier.capacity_bytes": 4096 * (n + 64)})
    budget = d.servicer.stream_pack_bytes = 4000   # 333 blocks of data
    async with grpc.aio.insecure_channel(f"unix:{d.socket_path}") as ch:
        stub = pb_grpc.KVKeeperStub(ch)
        sid = await register(stub, block_bytes=tiny)
        ks = [key(i) for i in range(n)]
        res = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=ks,
                                                           transport=pb.TRANSPORT_STREAM))
        await stub.WriteBlocks(iter([pb.WriteChunk(session_id=sid,
                                                   reservation_id=res.reservation_id,
                                                   index=i, data=bytes([i % 256]) * tiny)
                                     for i in range(n)]))
        sums = [(1 << 64) - 1 - i for i in range(n)]   # ten-byte varints
        await stub.CommitSave(pb.CommitSaveRequest(session_id=sid,
                                                   reservation_id=res.reservation_id,
                                                   checksum_algo=pb.CHECKSUM_XXH3_64, checksums=sums))
        chunks = await _chunks(stub, sid, ks, pack=True)
    assert [len(c.checksums) for c in chunks] == \
        [0, 2, 4, 8, 16, 32, 64, 128, MAX_PACK_BLOCKS, 9]   # the first alone: no checksums field
    assert all(c.ByteSize() <= budget + CHUNK_OVERHEAD_BYTES for c in chunks)
    assert [chunks[0].checksum] + [s for c in chunks[1:] for s in c.checksums] == sums


def test_stream_message_bytes_packs_blocks_that_fit_twice() -> None:
    from kvkeeper.server.api.chunks import stream_message_bytes

    KiB, MiB = 1 << 10, 1 << 20
    assert stream_message_bytes(192 * KiB) == 5 * 192 * KiB
    assert stream_message_bytes(256 * KiB) == 1 * MiB
    assert stream_message_bytes(512 * KiB) == 1 * MiB
    assert stream_message_bytes(512 * KiB + 1) == 512 * KiB + 1   # fits once: one block
    assert stream_message_bytes(1 * MiB) == 1 * MiB
    assert stream_message_bytes(1 * MiB + 1) == 1 * MiB   # a piece of one block
    assert stream_message_bytes(4 * MiB) == 1 * MiB
    assert stream_message_bytes(16) == 256 * 16          # MAX_PACK_BLOCKS
