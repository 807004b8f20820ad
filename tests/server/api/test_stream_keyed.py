"""A keyed LoadStream (LoadRequest.keys, lease_id 0): the daemon matches the
keys under a new lease and streams it in the same call; the first chunk names
the lease and how many keys matched. Read with the generated protobuf stub."""
from __future__ import annotations

import zlib
from typing import Any, List

import grpc
import pytest
from test_servicer_errors import BLOCK, key
from test_servicer_match_blocks import data, saved

from kvkeeper.client.stream import KEYED_UNKNOWN
from kvkeeper.v1 import kvkeeper_pb2 as pb


async def _keyed(stub: Any, sid: str, keys: List[bytes]) -> List[pb.BlockChunk]:
    req = pb.LoadRequest(session_id=sid, keys=keys, report_use=True, pack_blocks=True)
    return [c async for c in stub.LoadStream(req)]


async def test_a_keyed_stream_names_its_lease_then_streams_it(daemon: Any, stub: Any) -> None:
    sid, ks = await saved(stub, 3)
    head, *chunks = await _keyed(stub, sid, ks + [key(99)])   # the last one is missing
    assert head.matched == 3 and head.lease_id and not head.data
    assert daemon.ledger.leases[head.lease_id].report_use
    got = {}
    for c in chunks:
        sums = list(c.checksums) or [c.checksum]
        for j, s in enumerate(sums):
            got[c.index + j] = (c.data[j * BLOCK:(j + 1) * BLOCK], s)
    assert got == {i: (data(i), zlib.crc32(data(i))) for i in range(3)}
    await stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=head.lease_id))
    assert not daemon.ledger.leases
    daemon.ledger.check_invariants()


async def test_a_keyed_stream_that_matches_nothing_is_its_head_alone(daemon: Any,
                                                                     stub: Any) -> None:
    sid, _ = await saved(stub, 1)
    chunks = await _keyed(stub, sid, [key(50), key(0)])   # leading keys only: none
    assert [(c.lease_id, c.matched, c.data) for c in chunks] == [(0, 0, b"")]
    assert not daemon.ledger.leases


async def test_keys_of_another_length_are_refused_without_a_lease(daemon: Any,
                                                                  stub: Any) -> None:
    sid, _ = await saved(stub, 1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await _keyed(stub, sid, [b"short"])
    assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert not daemon.ledger.leases


async def test_lease_zero_without_keys_is_what_the_client_falls_back_on(daemon: Any,
                                                                        stub: Any) -> None:
    """What a daemon that does not know `keys` does with a keyed request (it
    looks for lease 0): an answer the client reads as "match first"."""
    sid, _ = await saved(stub, 1)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        async for _ in stub.LoadStream(pb.LoadRequest(session_id=sid, lease_id=0)):
            pass
    assert info.value.code() in KEYED_UNKNOWN
