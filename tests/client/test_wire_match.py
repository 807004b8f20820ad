"""Match's hand-written messages (client/wire.py) against the generated classes:
the request and the answer byte for byte as SerializeToString writes them, and
an answer parsed as protobuf parses it, whatever its layout (the parser's own
fast path, or protobuf for the rest)."""
from __future__ import annotations

import pytest
from google.protobuf.message import DecodeError
from hypothesis import given, settings
from hypothesis import strategies as st

from kvkeeper.client.wire import (WireError, encode_match_request, encode_match_response,
                                  parse_match_response)
from kvkeeper.server.api.convert import fill_block_columns, fill_refs
from kvkeeper.v1 import kvkeeper_pb2 as pb

SIDS = st.text(max_size=40)
FLAGS = st.booleans()
U32, U64 = (1 << 32) - 1, (1 << 64) - 1


@settings(max_examples=200, deadline=None)
@given(sid=SIDS, kb=st.integers(1, 300), n=st.integers(0, 40), lease=FLAGS, blocks=FLAGS,
       report=FLAGS, data=st.data())
def test_request_of_equal_length_keys_is_what_protobuf_writes(sid, kb, n, lease, blocks,
                                                              report, data):
    keys = [data.draw(st.binary(min_size=kb, max_size=kb)) for _ in range(n)]
    # With blocks, the refs are asked for as columns (client/columns.py).
    want = pb.MatchRequest(session_id=sid, keys=keys, lease=lease, blocks=blocks,
                           report_use=report, columns=blocks).SerializeToString()
    assert encode_match_request(sid, keys, kb, lease, blocks, report) == want


@settings(max_examples=200, deadline=None)
@given(sid=SIDS, keys=st.lists(st.binary(max_size=200), max_size=20), lease=FLAGS)
def test_request_of_keys_of_any_length_is_what_protobuf_writes(sid, keys, lease):
    """key_bytes 0 (a daemon that takes any length), empty keys included."""
    want = pb.MatchRequest(session_id=sid, keys=keys, lease=lease).SerializeToString()
    assert encode_match_request(sid, keys, 0, lease) == want


TIERS = st.lists(st.sampled_from([pb.TIER_UNSPECIFIED, pb.TIER_GPU, pb.TIER_HOST, pb.TIER_DISK]),
                 max_size=300)


@settings(max_examples=200, deadline=None)
@given(matched=st.integers(0, U32), tiers=TIERS | st.lists(st.integers(-2**31, 2**31 - 1),
                                                          max_size=20),
       lease=st.integers(0, U64))
def test_answer_is_what_protobuf_writes_and_parses_back(matched, tiers, lease):
    want = pb.MatchResponse(matched=matched, tiers=tiers, lease_id=lease).SerializeToString()
    got = encode_match_response(matched, tiers, lease)
    assert got == want
    r = parse_match_response(got)
    assert (r.matched, r.tiers, r.lease_id, list(r.blocks)) == (matched, tiers, lease, [])


def key(num: int, wire: int) -> bytes:
    return bytes([num << 3 | wire])


ODD_ANSWERS = [
    b"",                                                          # all defaults
    key(1, 0) + b"\x05" + key(1, 0) + b"\x07",                    # repeated scalar: last wins
    key(3, 0) + b"\x09" + key(1, 0) + b"\x02" + key(2, 2) + b"\x02\x02\x02",  # out of order
    key(1, 0) + b"\x02" + key(2, 0) + b"\x02" + key(2, 0) + b"\x01",  # tiers not packed
    key(2, 2) + b"\x01\x02" + key(2, 2) + b"\x01\x03",            # packed twice: appended
    key(1, 0) + b"\xff\xff\xff\xff\x1f",                          # uint32 from a wider varint
    key(1, 0) + b"\x01" + key(9, 2) + b"\x03abc",                 # an unknown field
    key(2, 2) + b"\x02\x80\x01",                                  # a two-byte tier value
    pb.MatchResponse(matched=1, tiers=[2], lease_id=4, blocks=[pb.BlockRef(
        key=b"k", extents=[pb.Extent(offset=8, length=4)], checksum=5)]).SerializeToString(),
]


@pytest.mark.parametrize("buf", ODD_ANSWERS)
def test_any_answer_parses_as_protobuf_parses_it(buf):
    m = pb.MatchResponse.FromString(buf)
    r = parse_match_response(buf)
    assert (r.matched, r.tiers, r.lease_id) == (m.matched, list(m.tiers), m.lease_id)
    assert list(r.blocks) == list(m.blocks)


@pytest.mark.parametrize("buf", [key(1, 0) + b"\x80", key(2, 2) + b"\x05\x02",
                                 key(3, 0), b"\x00\x01"])
def test_a_broken_answer_fails_as_protobuf_fails(buf):
    with pytest.raises(DecodeError):
        pb.MatchResponse.FromString(buf)
    with pytest.raises(DecodeError):
        parse_match_response(buf)


EXTENTS = st.lists(st.tuples(st.integers(0, U64), st.integers(0, U64)), max_size=3)


@settings(max_examples=100, deadline=None)
@given(refs=st.lists(st.tuples(st.binary(max_size=40), st.integers(0, 2), st.integers(0, U64),
                               EXTENTS), max_size=20))
def test_refs_in_columns_read_as_the_block_refs_they_stand_for(refs):
    keys = [k for k, _, _, _ in refs]
    sums = [(a, v) for _, a, v, _ in refs]
    exts = [e for _, _, _, e in refs]
    plain = pb.MatchResponse(matched=len(refs), lease_id=3)
    fill_refs(plain.blocks, keys, sums, exts)
    cols = pb.MatchResponse(matched=len(refs), lease_id=3)
    fill_block_columns(cols.columns, keys, sums, exts)
    want = parse_match_response(plain.SerializeToString()).blocks
    got = parse_match_response(cols.SerializeToString()).blocks
    assert len(got) == len(want) == len(refs)
    for g, w in zip(got, want):
        assert (g.key, g.checksum_algo, g.checksum) == (w.key, w.checksum_algo, w.checksum)
        assert [(e.offset, e.length) for e in g.extents] == \
            [(e.offset, e.length) for e in w.extents]


def test_columns_that_do_not_add_up_are_a_wire_error():
    m = pb.MatchResponse(matched=1, lease_id=3)
    fill_block_columns(m.columns, [b"k"], [(2, 5)], [[(8, 4)]])
    m.columns.key.append(b"extra")
    with pytest.raises(WireError, match="do not add up"):
        parse_match_response(m.SerializeToString())
