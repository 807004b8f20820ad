"""The hand-written BlockChunk / WriteChunk frames against the generated
protobuf classes: byte-identical serialization of random messages, and
parsing that agrees with protobuf's on anything it accepts (fields in any
order, repeated fields, unknown fields of every wire type, known fields with
another wire type) and fails where protobuf fails."""
from __future__ import annotations

import random
from typing import Any, List

import pytest
from google.protobuf.message import DecodeError

from kvkeeper.client.wire import (WireError, encode_block_chunk, encode_stream_head,
                                  encode_write_chunk,
                                  parse_block_chunk, parse_write_chunk, slice_views)
from kvkeeper.v1 import kvkeeper_pb2 as pb

U32, U64 = (1 << 32) - 1, (1 << 64) - 1


# An encoder independent of the module under test, for building odd messages.
def varint(v: int) -> bytes:
    v &= U64
    out = bytearray()
    while True:
        b = v & 0x7F
        v >>= 7
        out.append(b | (0x80 if v else 0))
        if not v:
            return bytes(out)


def field(num: int, wire: int, payload: bytes = b"", value: int = 0) -> bytes:
    key = varint(num << 3 | wire)
    if wire == 0:
        return key + varint(value)
    if wire == 2:
        return key + varint(len(payload)) + payload
    if wire == 1:
        return key + value.to_bytes(8, "little")
    if wire == 5:
        return key + (value & U32).to_bytes(4, "little")
    if wire == 3:   # a group holding one varint field
        return key + field(1, 0, value=value) + varint(num << 3 | 4)
    raise ValueError(wire)


def rand_int(rng: random.Random, bits: int) -> int:
    return rng.choice([0, 1, 127, 128, (1 << bits) - 1, rng.getrandbits(bits),
                       rng.getrandbits(rng.randint(1, bits))])


def rand_algo(rng: random.Random) -> int:
    # known values, unknown ones (proto3 enums are open) and negative ones
    return rng.choice([0, pb.CHECKSUM_CRC32, pb.CHECKSUM_XXH3_64, 7, 1 << 30, -1, -(1 << 31)])


def pieces(rng: random.Random, data: bytes) -> List[Any]:
    cuts = sorted(rng.sample(range(len(data) + 1), min(3, len(data) + 1)))
    bounds = [0, *cuts, len(data)]
    kinds = [bytes, bytearray, memoryview]
    return [rng.choice(kinds)(data[a:b]) for a, b in zip(bounds, bounds[1:])]


def same_chunk(got: Any, want: pb.BlockChunk) -> None:
    assert (got.index, got.offset, bytes(got.data), got.checksum_algo, got.checksum,
            list(got.checksums), got.lease_id, got.matched) == \
        (want.index, want.offset, want.data, want.checksum_algo, want.checksum,
         list(want.checksums), want.lease_id, want.matched)


def same_write(got: Any, want: pb.WriteChunk) -> None:
    assert (got.session_id, got.reservation_id, got.index, got.offset, bytes(got.data)) == \
        (want.session_id, want.reservation_id, want.index, want.offset, want.data)


@pytest.mark.parametrize("seed", range(300))
def test_block_chunk_frames_are_protobufs_bytes(seed: int) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(rng.choice([0, 1, 5, 127, 128, 300, 16384 + 3]))
    msg = pb.BlockChunk(index=rand_int(rng, 32), offset=rand_int(rng, 64), data=data,
                        checksum_algo=rand_algo(rng), checksum=rand_int(rng, 64),
                        checksums=[rand_int(rng, 64) for _ in range(rng.choice([0, 0, 1, 5]))])
    wire = msg.SerializeToString()
    assert encode_block_chunk(msg.index, msg.offset, pieces(rng, data), msg.checksum_algo,
                              msg.checksum, list(msg.checksums)) == wire
    got = parse_block_chunk(wire)
    same_chunk(got, msg)
    assert got.data.readonly


@pytest.mark.parametrize("seed", range(200))
def test_write_chunk_frames_are_protobufs_bytes(seed: int) -> None:
    rng = random.Random(seed)
    data = rng.randbytes(rng.choice([0, 1, 200, 5000]))
    sid = rng.choice(["", "s-1", "sessión-" + "x" * rng.randint(0, 200)])
    msg = pb.WriteChunk(session_id=sid, reservation_id=rand_int(rng, 64),
                        index=rand_int(rng, 32), offset=rand_int(rng, 64), data=data)
    wire = msg.SerializeToString()
    assert encode_write_chunk(sid, msg.reservation_id, msg.index, msg.offset,
                              pieces(rng, data)) == wire
    same_write(parse_write_chunk(wire), msg)


def unknown_fields(rng: random.Random, known: set) -> List[bytes]:
    out = []
    for _ in range(rng.randint(1, 4)):
        num = rng.choice([n for n in (6, 7, 15, 16, 100, 2047, 536870911) if n not in known])
        wire = rng.choice([0, 1, 2, 3, 5])
        out.append(field(num, wire, rng.randbytes(rng.randint(0, 20)), rng.getrandbits(60)))
    return out


@pytest.mark.parametrize("seed", range(300))
def test_block_chunk_parse_agrees_with_protobuf_on_odd_messages(seed: int) -> None:
    rng = random.Random(seed)
    parts = [field(1, 0, value=rand_int(rng, 64)),   # index: truncated to 32 bits
             field(2, 0, value=rand_int(rng, 64)),
             field(3, 2, rng.randbytes(rng.randint(0, 50))),
             field(4, 0, value=rand_algo(rng)),
             field(5, 0, value=rand_int(rng, 64)),
             # checksums: packed (as protobuf writes them) and one by one
             field(6, 2, b"".join(varint(rand_int(rng, 64)) for _ in range(rng.randint(0, 4)))),
             field(6, 0, value=rand_int(rng, 64)),
             field(7, 0, value=rand_int(rng, 64)), field(8, 0, value=rand_int(rng, 64))]
    parts += [field(rng.choice([1, 2, 3, 4, 5]), 0 if rng.random() < 0.7 else 2,
                    rng.randbytes(rng.randint(0, 9)), rng.getrandbits(64))
              for _ in range(rng.randint(0, 3))]    # repeats; some of another wire type
    parts += [field(rng.choice([1, 2, 4, 5]), rng.choice([1, 5]), value=rng.getrandbits(32))
              for _ in range(rng.randint(0, 2))]   # known numbers, fixed wire types
    parts += unknown_fields(rng, {1, 2, 3, 4, 5, 6, 7, 8})
    rng.shuffle(parts)
    wire = b"".join(rng.sample(parts, rng.randint(0, len(parts))))
    same_chunk(parse_block_chunk(wire), pb.BlockChunk.FromString(wire))


@pytest.mark.parametrize("seed", range(200))
def test_write_chunk_parse_agrees_with_protobuf_on_odd_messages(seed: int) -> None:
    rng = random.Random(seed)
    parts = [field(1, 2, rng.choice(["", "abc", "ßüñ"]).encode()),
             field(2, 0, value=rand_int(rng, 64)), field(3, 0, value=rand_int(rng, 64)),
             field(4, 0, value=rand_int(rng, 64)), field(5, 2, rng.randbytes(rng.randint(0, 40))),
             field(5, 2, rng.randbytes(rng.randint(0, 40))),   # the last one wins
             field(1, 2, b"second")]
    parts += unknown_fields(rng, {1, 2, 3, 4, 5})
    rng.shuffle(parts)
    wire = b"".join(rng.sample(parts, rng.randint(0, len(parts))))
    same_write(parse_write_chunk(wire), pb.WriteChunk.FromString(wire))


@pytest.mark.parametrize("wire", [
    b"\x08",                          # truncated varint
    b"\x08" + b"\xff" * 10 + b"\x01",  # varint of 11 bytes
    b"\x1a\x05abc",                   # bytes field shorter than its length
    b"\x31\x00\x00",                  # truncated fixed64 (field 6)
    b"\x35\x00",                      # truncated fixed32 (field 6)
    b"\x00\x01",                      # field number 0
    b"\x0f\x01",                      # wire type 7
    b"\x34",                          # a group end with no group
    b"\x33\x08\x01",                  # a group that never ends
    b"\x33\x08\x01\x3c",              # a group closed by another field number
])
def test_malformed_messages_fail_like_protobuf(wire: bytes) -> None:
    with pytest.raises(DecodeError):
        pb.BlockChunk.FromString(wire)
    with pytest.raises(WireError):
        parse_block_chunk(wire)
    with pytest.raises(DecodeError):
        pb.WriteChunk.FromString(wire)
    with pytest.raises(WireError):
        parse_write_chunk(wire)


@pytest.mark.parametrize("message,parse,wire", [
    # packed checksums that end mid-varint
    (pb.BlockChunk, parse_block_chunk, field(6, 2, b"\x01\xff")),
    # a session id that is not UTF-8
    (pb.WriteChunk, parse_write_chunk, field(1, 2, b"\xff\xfe")),
])
def test_bad_field_values_fail_like_protobuf(message: Any, parse: Any, wire: bytes) -> None:
    with pytest.raises(DecodeError):
        message.FromString(wire)
    with pytest.raises(WireError):
        parse(wire)


@pytest.mark.parametrize("lease_id,matched", [(0, 0), (1, 0), (5, 3), ((1 << 64) - 1, (1 << 32) - 1)])
def test_a_keyed_streams_head_is_protobufs_bytes(lease_id: int, matched: int) -> None:
    wire = pb.BlockChunk(lease_id=lease_id, matched=matched).SerializeToString()
    assert encode_stream_head(lease_id, matched) == wire
    got = parse_block_chunk(wire)
    assert (got.lease_id, got.matched, got.data.nbytes) == (lease_id, matched, 0)


def test_data_is_a_view_of_the_message_not_a_copy() -> None:
    msg = pb.BlockChunk(index=3, offset=8, data=b"abcdef").SerializeToString()
    ch = parse_block_chunk(msg)
    assert ch.data.obj is msg and bytes(ch.data) == b"abcdef"


@pytest.mark.parametrize("seed", range(50))
def test_slice_views_cuts_the_concatenation(seed: int) -> None:
    rng = random.Random(seed)
    bufs = [rng.randbytes(rng.randint(0, 30)) for _ in range(rng.randint(1, 5))]
    whole = b"".join(bufs)
    start = rng.randint(0, len(whole))
    n = rng.randint(0, len(whole) - start + 5)
    got = slice_views([memoryview(b) for b in bufs], start, n)
    assert b"".join(got) == whole[start:start + n]
    assert all(len(v) for v in got)
