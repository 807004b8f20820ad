"""LoadStream's chunks fit the daemon's own server.max_message_bytes: a block
larger than the limit still streams (it used to go in 1 MiB chunks, which grpc
refused to send: RESOURCE_EXHAUSTED "Sent message larger than max"). Found
while fuzzing the stubs with a small message limit."""
from __future__ import annotations

from typing import Any

import grpc

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

LIMIT = 128 * 1024
BLOCK = 2 * LIMIT + 100


async def test_a_block_above_the_message_limit_streams_in_chunks_that_fit(daemon_factory: Any) -> None:
    d = await daemon_factory(**{"server.max_message_bytes": LIMIT,
                                "host_tier.capacity_bytes": 4096 + 4 * (BLOCK + 4096)})
    async with grpc.aio.insecure_channel(f"unix:{d.socket_path}") as ch:
        stub = pb_grpc.KVKeeperStub(ch)
        reg = await stub.RegisterSession(pb.RegisterSessionRequest(namespace=pb.NamespaceDescriptor(
            model_id="big", dtype="float16", block_tokens=16, block_bytes=BLOCK)))
        sid, keys = reg.session_id, [bytes([1]) * 32, bytes([2]) * 32]
        blocks = [bytes(range(256)) * (BLOCK // 256) + b"\x07" * (BLOCK % 256), b"\x09" * BLOCK]
        r = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=keys,
                                                         transport=pb.TRANSPORT_STREAM))
        step = LIMIT // 2   # what a client writes with: under the limit
        await stub.WriteBlocks(iter([pb.WriteChunk(session_id=sid, reservation_id=r.reservation_id,
                                                   index=i, offset=o, data=b[o:o + step])
                                     for i, b in enumerate(blocks) for o in range(0, BLOCK, step)]))
        await stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=r.reservation_id))
        m = await stub.Match(pb.MatchRequest(session_id=sid, keys=keys, lease=True))
        chunks = [c async for c in stub.LoadStream(pb.LoadRequest(session_id=sid, lease_id=m.lease_id))]
    assert all(c.ByteSize() <= LIMIT for c in chunks)
    assert [b"".join(c.data for c in chunks if c.index == i) for i in range(2)] == blocks
    assert [c.offset for c in chunks if c.index == 0] == list(range(0, BLOCK, d.servicer.stream_chunk_bytes))
