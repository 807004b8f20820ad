"""WriteBlocks with packed chunks (ReserveSaveResponse.pack_writes): data of
k whole blocks at offset 0 fills entries index .. index + k - 1."""
from __future__ import annotations

from typing import Any

import grpc
import pytest
from test_servicer_errors import BLOCK, expect, key, register

from kvkeeper.v1 import kvkeeper_pb2 as pb


def body(i: int) -> bytes:
    return bytes([i + 1]) * BLOCK


async def _reserve(stub: Any, n: int, transport: int = pb.TRANSPORT_STREAM) -> tuple:
    sid = await register(stub)
    r = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=[key(i) for i in range(n)],
                                                     transport=transport))
    return sid, r


async def test_a_stream_reservation_takes_packed_chunks(daemon: Any, stub: Any) -> None:
    sid, r = await _reserve(stub, 4)
    assert r.pack_writes
    first = dict(session_id=sid, reservation_id=r.reservation_id)
    ok = await stub.WriteBlocks(iter([
        pb.WriteChunk(**first, index=0, data=body(0) + body(1) + body(2)),
        pb.WriteChunk(index=3, data=body(3))]))
    assert ok.bytes_written == 4 * BLOCK
    c = await stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=r.reservation_id))
    assert c.committed == 4
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=[key(i) for i in range(4)],
                                         lease=True, blocks=True))
    assert [daemon.arena.read(b.extents) for b in m.blocks] == [body(i) for i in range(4)]
    daemon.ledger.check_invariants()


async def test_shared_memory_reservations_do_not_offer_it(stub: Any) -> None:
    _, r = await _reserve(stub, 1, pb.TRANSPORT_SHM)
    assert not r.pack_writes


@pytest.mark.parametrize("data,index,code,fragment", [
    (b"x" * (2 * BLOCK + 7), 0, grpc.StatusCode.OUT_OF_RANGE, "no whole number of blocks"),
    (b"x" * (3 * BLOCK), 2, grpc.StatusCode.INVALID_ARGUMENT, "was not reserved"),   # 2..4 of 4
])
async def test_a_packed_chunk_that_does_not_fit_is_refused(daemon: Any, stub: Any, data: bytes,
                                                           index: int, code: Any,
                                                           fragment: str) -> None:
    sid, r = await _reserve(stub, 4)
    await expect(code, stub.WriteBlocks(iter([pb.WriteChunk(
        session_id=sid, reservation_id=r.reservation_id, index=index, data=data)])), fragment)
    daemon.ledger.check_invariants()
