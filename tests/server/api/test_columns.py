"""ReserveSave's and Load's answers as columns (ReserveSaveRequest.columns,
LoadRequest.columns): the same slots and refs as the messages per slot and
per block that every client without the flag still gets."""
from __future__ import annotations

from types import SimpleNamespace as NS
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st
from test_servicer_errors import BLOCK, key, register

from kvkeeper.client.columns import refs_of, slots_of, stored_of
from kvkeeper.client.copies import stored
from kvkeeper.server.api.convert import (block_runs, fill_block_columns, fill_block_runs,
                                         fill_refs, fill_slot_runs, fill_slots)
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


_RUN = st.one_of(st.none(), st.integers(0, 2**48))


@given(st.lists(st.tuples(_STATUS, _RUN), max_size=40), st.integers(1, 2**32))
def test_slot_runs_answer_as_the_same_extents_do(slots: list, nbytes: int) -> None:
    """The daemon's usual ReserveSave answer (each block one run of pages,
    Arena.run_offsets) is the message the extents of each block make."""
    statuses = [s for s, _ in slots]
    runs = pb.ReserveSaveResponse(reservation_id=1)
    fill_slot_runs(runs, statuses, [o for _, o in slots], nbytes)
    ext = pb.ReserveSaveResponse(reservation_id=1)
    fill_slots(ext, statuses, [[] if o is None else [(o, nbytes)] for _, o in slots], True)
    assert runs == ext and runs.HasField("columns")


@given(st.lists(st.tuples(st.binary(min_size=1, max_size=8), st.integers(0, 2),
                          st.integers(0, 2**64 - 1), st.integers(0, 2**48)), max_size=40),
       st.integers(1, 2**32))
def test_block_runs_answer_as_the_same_extents_do(refs: list, nbytes: int) -> None:
    keys, sums = [k for k, *_ in refs], [(a, v) for _, a, v, _ in refs]
    runs, ext = pb.BlockColumns(), pb.BlockColumns()
    fill_block_runs(runs, keys, sums, [o for *_, o in refs], nbytes)
    fill_block_columns(ext, keys, sums, [[(o, nbytes)] for *_, o in refs])
    assert runs == ext


async def test_block_runs_only_where_every_block_is_one_run(daemon: Any) -> None:
    arena, ns = daemon.arena, NS(pages_per_block=4, block_bytes=BLOCK)
    d, pb_ = arena.data_offset, arena.page_bytes
    assert block_runs(arena, [NS(pages=2, ns=ns), None]) == ([d + 2 * pb_, None], BLOCK)
    assert block_runs(arena, [None, None]) is None and block_runs(arena, []) is None
    # a block in pieces (pages freed here and there): extents block by block
    assert block_runs(arena, [NS(pages=2, ns=ns), NS(pages=(9, 10, 4, 5), ns=ns)]) is None


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
