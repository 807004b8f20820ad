"""ReserveSave's parent_key on the wire: a save that continues a chain is filed
under the block it extends, a chain's first block under none, an unset one as
the last Match says; a bad one is INVALID_ARGUMENT and changes nothing."""
from __future__ import annotations

from typing import Any, Optional

import grpc

from test_servicer_errors import expect, key, register, snapshot

from kvkeeper.server.ledger.chains import GONE
from kvkeeper.v1 import kvkeeper_pb2 as pb


async def reserve(stub: Any, sid: str, keys: list[bytes], parent: Optional[bytes] = None) -> int:
    """Reserve and commit over shared memory (the bytes do not matter here)."""
    r = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=keys,
                                                     transport=pb.TRANSPORT_SHM,
                                                     parent_key=parent))
    if r.reservation_id:
        await stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=r.reservation_id))
    return r.reservation_id


def block(daemon: Any, k: bytes) -> Any:
    L = daemon.ledger
    (ns,) = L.namespaces.values()
    return ns.blocks[k]


async def test_a_named_parent_links_saves_of_one_chain(daemon: Any, stub: Any) -> None:
    sid = await register(stub)
    await reserve(stub, sid, [key(0), key(1)], parent=b"")
    await reserve(stub, sid, [key(2), key(3)], parent=key(1))     # the next prefill chunk
    b0, b1, b2, b3 = (block(daemon, key(i)) for i in range(4))
    assert b0.parent is None and b1.parent is b0
    assert b2.parent is b1 and b3.parent is b2
    await reserve(stub, sid, [key(7)], parent=key(6))             # its parent is not cached
    assert block(daemon, key(7)).parent is GONE
    daemon.ledger.check_invariants()


async def test_unset_parent_is_taken_from_the_last_match(daemon: Any, stub: Any) -> None:
    sid = await register(stub)
    await reserve(stub, sid, [key(0), key(1)])
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=[key(0), key(1), key(2)]))
    assert m.matched == 2
    await reserve(stub, sid, [key(2)])                            # no parent_key on the wire
    assert block(daemon, key(2)).parent is block(daemon, key(1))
    # Named empty, the hint is not asked: the block starts a chain.
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=[key(0), key(1), key(2), key(3)]))
    await reserve(stub, sid, [key(3)], parent=b"")
    assert block(daemon, key(3)).parent is None
    daemon.ledger.check_invariants()


async def test_a_bad_parent_key_is_invalid_and_changes_nothing(daemon: Any, stub: Any) -> None:
    sid = await register(stub)
    await reserve(stub, sid, [key(0)])
    before = snapshot(daemon)
    await expect(grpc.StatusCode.INVALID_ARGUMENT,
                 stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=[key(1)],
                                                        parent_key=b"short")),
                 "parent key has 5 bytes")
    await expect(grpc.StatusCode.INVALID_ARGUMENT,
                 stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=[key(1), key(2)],
                                                        parent_key=key(2))),
                 "parent key is one of the keys")
    assert snapshot(daemon) == before
