"""ReserveSave's and Load's answers as columns (ReserveSaveRequest.columns,
LoadRequest.columns): the same slots and refs as the messages per slot and
per block that every client without the flag still gets."""
from __future__ import annotations

from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_servicer_errors import BLOCK, key, register

from kvkeeper.client.columns import refs_of, slots_of, stored_of
from kvkeeper.client.copies import stored
from kvkeeper.server.api.convert import fill_block_columns, fill_refs, fill_slots
from kvkeeper.v1 import kvkeeper_pb2 as pb

_STATUS = st.sampled_from([pb.SLOT_RESERVED, pb.SLOT_PRESENT, pb.SLOT_IN_FLIGHT,
                           pb.SLOT_NOT_ADMITTED])
_EXTENTS = st.lists(st.tuples(st.integers(0, 2**48), st.integers(1, 2**32)), max_size=3)


@given(st.lists(st.tuples(_STATUS, _EXTENTS), max_size=40))
def test_both_answers_read_back_as_the_slots_given(slots: list) -> None:
    statuses = [s for s, _ in slots]
    extents = [e for _, e in slots]
    for columns in (False, True):
        resp = pb.ReserveSaveResponse(reservation_id=1)
        fill_slots(resp, statuses, extents, columns)
        back = pb.ReserveSaveResponse.FromString(resp.SerializeToString())
        assert back.HasField("columns") is columns
        assert len(back.slots) == (0 if columns else len(slots))
        assert slots_of(back) == [(s, list(e)) for s, e in slots]


@pytest.mark.parametrize("field,extra", [("extent_count", 1), ("offset", 5), ("length", 5)])
def test_columns_that_do_not_add_up_are_refused(field: str, extra: int) -> None:
    resp = pb.ReserveSaveResponse(reservation_id=1)
    fill_slots(resp, [pb.SLOT_RESERVED] * 2, [[(0, 4)], [(8, 4), (16, 4)]], True)
    slots_of(resp)   # as built: fine
    getattr(resp.columns, field).append(extra)
    with pytest.raises(ValueError, match="columns do not add up"):
        slots_of(resp)


def _truth(daemon: Any, rid: int, n: int) -> list:
    """Each key's extents as the ledger's reservation holds them (none for a
    slot it did not reserve)."""
    res = daemon.ledger.reservations[rid]
    arena = daemon.arena
    return [[] if b is None else arena.extents(b.pages, b.ns.pages_per_block, BLOCK)
            for b in res.entries]


@pytest.mark.parametrize("transport", [pb.TRANSPORT_SHM, pb.TRANSPORT_STREAM])
@pytest.mark.parametrize("columns", [False, True])
async def test_the_daemon_answers_what_was_asked_with_every_status(
        daemon: Any, stub: Any, transport: int, columns: bool) -> None:
    sid = await register(stub)
    keys = [key(i) for i in range(6)]
    # keys 0-1 committed (PRESENT), key 2 held by an open reservation (IN_FLIGHT)
    done = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=keys[:2],
                                                        transport=pb.TRANSPORT_SHM))
    await stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=done.reservation_id))
    await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=keys[2:3],
                                                 transport=pb.TRANSPORT_SHM))
    r = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=keys,
                                                     transport=transport, columns=columns))
    assert r.HasField("columns") is columns
    assert len(r.slots) == (0 if columns else len(keys))
    slots = slots_of(r)
    assert [s for s, _ in slots] == [pb.SLOT_PRESENT] * 2 + [pb.SLOT_IN_FLIGHT] + \
        [pb.SLOT_RESERVED] * 3
    want = (_truth(daemon, r.reservation_id, len(keys)) if transport == pb.TRANSPORT_SHM
            else [[]] * len(keys))
    assert [e for _, e in slots] == want
    assert all(want[3:]) or transport == pb.TRANSPORT_STREAM
    daemon.ledger.check_invariants()


_ALGO = st.sampled_from([pb.CHECKSUM_NONE, pb.CHECKSUM_CRC32, pb.CHECKSUM_XXH3_64])


@given(st.lists(st.tuples(st.binary(min_size=1, max_size=8), _ALGO, st.integers(0, 2**64 - 1),
                          _EXTENTS), max_size=40))
def test_both_load_answers_read_back_as_the_refs_given(refs: list) -> None:
    keys = [k for k, _, _, _ in refs]
    sums = [(a, v) for _, a, v, _ in refs]
    extents = [e for _, _, _, e in refs]
    want = [(a, v, list(e)) for _, a, v, e in refs]
    plain = pb.LoadResponse()
    fill_refs(plain.blocks, keys, sums, extents)
    cols = pb.LoadResponse()
    fill_block_columns(cols.columns, keys, sums, extents)
    for resp, columns in ((plain, False), (cols, True)):
        back = pb.LoadResponse.FromString(resp.SerializeToString())
        assert back.HasField("columns") is columns
        assert stored_of(back) == want
    assert [r.key for r in plain.blocks] == list(cols.columns.key) == keys


def test_load_columns_that_do_not_add_up_are_refused() -> None:
    resp = pb.LoadResponse()
    fill_block_columns(resp.columns, [b"a", b"b"], [(1, 2), (1, 3)], [[(0, 4)], [(8, 4)]])
    stored_of(resp)
    resp.columns.checksum.append(7)
    with pytest.raises(ValueError, match="columns do not add up"):
        stored_of(resp)


async def _saved(stub: Any, n: int, first_sum: int) -> tuple:
    """A session with keys 0..n-1 committed over shm, checksums first_sum + i:
    (session id, keys, the ReserveSave answer)."""
    sid = await register(stub)
    keys = [key(i) for i in range(n)]
    r = await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=keys,
                                                     transport=pb.TRANSPORT_SHM, columns=True))
    await stub.CommitSave(pb.CommitSaveRequest(
        session_id=sid, reservation_id=r.reservation_id, checksum_algo=pb.CHECKSUM_XXH3_64,
        checksums=[first_sum + i for i in range(n)]))
    return sid, keys, r


async def test_load_answers_the_same_refs_either_way(daemon: Any, stub: Any) -> None:
    sid, keys, r = await _saved(stub, 5, 100)
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=keys, lease=True))
    plain = await stub.Load(pb.LoadRequest(session_id=sid, lease_id=m.lease_id))
    cols = await stub.Load(pb.LoadRequest(session_id=sid, lease_id=m.lease_id, columns=True))
    assert not plain.HasField("columns") and len(plain.blocks) == 5
    assert cols.HasField("columns") and not cols.blocks
    assert stored_of(cols) == stored(plain.blocks) == [
        (pb.CHECKSUM_XXH3_64, 100 + i, e) for i, (_, e) in enumerate(slots_of(r))]
    assert list(cols.columns.key) == keys
    daemon.ledger.check_invariants()


async def test_match_answers_its_refs_in_columns_when_asked(daemon: Any, stub: Any) -> None:
    sid, keys, r = await _saved(stub, 4, 7)
    plain = await stub.Match(pb.MatchRequest(session_id=sid, keys=keys, lease=True, blocks=True))
    cols = await stub.Match(pb.MatchRequest(session_id=sid, keys=keys, lease=True, blocks=True,
                                            columns=True))
    assert len(plain.blocks) == 4 and not plain.HasField("columns")
    assert not cols.blocks and cols.HasField("columns")
    want = [(b.key, b.checksum_algo, b.checksum, [(e.offset, e.length) for e in b.extents])
            for b in plain.blocks]
    assert [(r.key, r.checksum_algo, r.checksum, [(e.offset, e.length) for e in r.extents])
            for r in refs_of(cols.columns)] == want
    assert [w[3] for w in want] == [e for _, e in slots_of(r)]
    daemon.ledger.check_invariants()
