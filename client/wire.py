"""BlockChunk and WriteChunk (and Match's two messages), serialized and parsed by hand.

The two streaming messages carry the bulk bytes of loads and saves. Through
the generated protobuf classes each chunk's bytes are copied about four
times on the way (build the message, serialize it, parse it, read `.data`);
here the sender builds a frame in one copy straight from its buffers (e.g.
views of the daemon's arena) and the receiver keeps `data` as a zero-copy
memoryview of the received message. gRPC itself still copies each message
once on each side.

The frames are the protobuf wire format, byte for byte what
SerializeToString produces (fields in field-number order, proto3 defaults
omitted), so any other client or server interoperates. The parsers accept
everything protobuf's parser does for these messages: fields in any order,
repeated scalars (the last wins), unknown fields of every wire type, and a
known field sent with another wire type (kept as unknown, as protobuf does).
Tests check both against kvkeeper_pb2 (tests/client/test_wire.py).

Match is the connector's call per scheduled request: its 256 keys and 256
tiers cost more through the generated classes (a copy of every key into
the message, then one Python int per tier) than one join and one slice here.
Its parser takes the canonical answer (no BlockRefs) itself and hands
anything else to protobuf (tests/client/test_wire_match.py).

Wire format: each field is a key varint (field_number << 3 | wire_type), then
a varint (type 0), 8 bytes (1), a varint length and that many bytes (2), or
4 bytes (5); types 3 and 4 open and close a group.
"""
from __future__ import annotations

from typing import Any, List, NamedTuple, Sequence, Tuple

from kvkeeper.v1 import kvkeeper_pb2 as pb

from .columns import refs_of

__all__ = ["Chunk", "MatchReply", "WriteChunkView", "encode_block_chunk",
           "encode_match_request", "encode_match_response", "encode_stream_head",
           "encode_write_chunk",
           "frame_or_message", "parse_block_chunk", "parse_match_response", "parse_write_chunk",
           "slice_views", "WireError"]

_U32 = 0xFFFFFFFF
_U64 = 0xFFFFFFFFFFFFFFFF


class WireError(ValueError):
    """A message that is not valid protobuf wire format."""


class Chunk(NamedTuple):
    """A parsed BlockChunk; `data` is a read-only view into the received message.
    checksums: set only on a chunk of several whole blocks (stream.unpack
    splits it into one Chunk per block)."""

    index: int
    offset: int
    data: memoryview
    checksum_algo: int
    checksum: int
    checksums: Tuple[int, ...] = ()
    lease_id: int = 0   # a keyed LoadStream's first chunk (no data): the lease it streams
    matched: int = 0


class WriteChunkView(NamedTuple):
    """A parsed WriteChunk; `data` is a read-only view into the received message."""

    session_id: str
    reservation_id: int
    index: int
    offset: int
    data: memoryview


# ---------------------------------------------------------------- encoding

def _varint(v: int) -> bytes:
    out = bytearray()
    while v > 0x7F:
        out.append((v & 0x7F) | 0x80)
        v >>= 7
    out.append(v)
    return bytes(out)


def _scalar(field: int, v: int) -> bytes:
    """A varint field; nothing for 0 (proto3 leaves defaults out)."""
    if not v:
        return b""
    if v < 0:   # int32/enum: ten-byte two's complement, as protobuf writes it
        v &= _U64
    return _varint(field << 3) + _varint(v)


def _length(pieces: Sequence[Any]) -> Tuple[List[memoryview], int]:
    views = [p if isinstance(p, memoryview) else memoryview(p) for p in pieces]
    return views, sum(v.nbytes for v in views)


def _bytes_field(field: int, n: int) -> bytes:
    return _varint(field << 3 | 2) + _varint(n) if n else b""


def frame_or_message(msg: Any) -> bytes:
    """A response serializer for a stream of frames built here: frames
    (bytes) go as they are, protobuf messages are serialized."""
    return msg if type(msg) is bytes else msg.SerializeToString()


def slice_views(views: Sequence[memoryview], start: int, n: int) -> List[memoryview]:
    """The pieces of bytes [start, start + n) of the concatenation of `views`
    (flat byte views), without copying."""
    out: List[memoryview] = []
    pos = 0
    end = start + n
    for v in views:
        ln = len(v)
        lo, hi = max(start - pos, 0), min(end - pos, ln)
        if lo < hi:
            out.append(v[lo:hi])
        pos += ln
        if pos >= end:
            break
    return out


def encode_block_chunk(index: int, offset: int, pieces: Sequence[Any],
                       checksum_algo: int = 0, checksum: int = 0,
                       checksums: Sequence[int] = ()) -> bytes:
    """A serialized BlockChunk whose data is the concatenation of `pieces`
    (buffers, e.g. arena views), copied once into the frame. checksums: of
    the whole blocks a packed chunk holds (written packed, as protobuf does)."""
    views, n = _length(pieces)
    head = _scalar(1, index & _U32) + _scalar(2, offset & _U64) + _bytes_field(3, n)
    tail = _scalar(4, checksum_algo) + _scalar(5, checksum & _U64)
    if checksums:
        packed = b"".join(_varint(c & _U64) for c in checksums)
        tail += _bytes_field(6, len(packed)) + packed
    if not n:
        return head + tail
    return b"".join([head, *views, tail])


def encode_stream_head(lease_id: int, matched: int) -> bytes:
    """A keyed LoadStream's first BlockChunk: the lease it streams, and how
    many keys matched (both 0: nothing did)."""
    return _scalar(7, lease_id & _U64) + _scalar(8, matched & _U32)


def encode_write_chunk(session_id: str, reservation_id: int, index: int, offset: int,
                       pieces: Sequence[Any]) -> bytes:
    """A serialized WriteChunk whose data is the concatenation of `pieces`."""
    views, n = _length(pieces)
    sid = session_id.encode()
    head = (_bytes_field(1, len(sid)) + sid + _scalar(2, reservation_id & _U64)
            + _scalar(3, index & _U32) + _scalar(4, offset & _U64) + _bytes_field(5, n))
    return b"".join([head, *views]) if n else head


# ---------------------------------------------------------------- parsing

def _read_varint(buf: bytes, pos: int, end: int) -> Tuple[int, int]:
    v = shift = 0
    while True:
        if pos >= end:
            raise WireError("truncated varint")
        b = buf[pos]
        pos += 1
        v |= (b & 0x7F) << shift
        if b < 0x80:
            return v & _U64, pos
        shift += 7
        if shift >= 70:
            raise WireError("varint longer than 10 bytes")


def _skip(buf: bytes, pos: int, end: int, wire: int, field: int) -> int:
    """The position after an unknown field's value (wire type `wire`)."""
    if wire == 0:
        return _read_varint(buf, pos, end)[1]
    if wire == 1:
        pos += 8
    elif wire == 5:
        pos += 4
    elif wire == 2:
        n, pos = _read_varint(buf, pos, end)
        pos += n
    elif wire == 3:   # a group: skip fields up to its matching end
        while True:
            key, pos = _read_varint(buf, pos, end)
            if key & 7 == 4:
                if key >> 3 != field:
                    raise WireError("mismatched group end")
                return pos
            pos = _skip(buf, pos, end, key & 7, key >> 3)
    else:
        raise WireError(f"invalid wire type {wire}")
    if pos > end:
        raise WireError("truncated field")
    return pos


def _fields(buf: Any, varints: frozenset, blobs: frozenset):
    """Yield (field, value) of the varint fields in `varints` and the
    length-delimited fields in `blobs` ((start, end) into buf), skipping
    everything else."""
    end = len(buf)
    pos = 0
    while pos < end:
        key, pos = _read_varint(buf, pos, end)
        field, wire = key >> 3, key & 7
        if field == 0:
            raise WireError("field number 0")
        if wire == 0 and field in varints:
            v, pos = _read_varint(buf, pos, end)
            yield field, v
        elif wire == 2 and field in blobs:
            n, pos = _read_varint(buf, pos, end)
            if pos + n > end:
                raise WireError("truncated bytes field")
            yield field, (pos, pos + n)
            pos += n
        elif wire == 4:
            raise WireError("unexpected group end")
        else:
            pos = _skip(buf, pos, end, wire, field)


def _int32(v: int) -> int:
    v &= _U32
    return v - (1 << 32) if v & 0x80000000 else v


_CHUNK_VARINTS = frozenset((1, 2, 4, 5, 6, 7, 8))
_CHUNK_BLOBS = frozenset((3, 6))
_EMPTY = memoryview(b"")


def _packed_varints(buf: Any, start: int, end: int) -> List[int]:
    out = []
    pos = start
    while pos < end:
        v, pos = _read_varint(buf, pos, end)
        out.append(v)
    return out


def parse_block_chunk(buf: bytes) -> Chunk:
    """A BlockChunk from its serialized bytes (gRPC's response deserializer)."""
    index = offset = algo = checksum = lease_id = matched = 0
    data = None
    sums: List[int] = []
    for field, v in _fields(buf, _CHUNK_VARINTS, _CHUNK_BLOBS):
        if field == 7:
            lease_id = v
        elif field == 8:
            matched = v & _U32
        elif field == 1:
            index = v & _U32
        elif field == 2:
            offset = v
        elif field == 3:
            data = v
        elif field == 4:
            algo = _int32(v)
        elif field == 5:
            checksum = v
        elif type(v) is tuple:   # 6, packed (what protobuf writes)
            sums += _packed_varints(buf, v[0], v[1])
        else:                    # 6, one value unpacked (protobuf's parser takes both)
            sums.append(v)
    mv = memoryview(buf)[data[0]:data[1]].toreadonly() if data else _EMPTY
    return Chunk(index, offset, mv, algo, checksum, tuple(sums), lease_id, matched)


_WRITE_VARINTS = frozenset((2, 3, 4))
_WRITE_BLOBS = frozenset((1, 5))


def parse_write_chunk(buf: bytes) -> WriteChunkView:
    """A WriteChunk from its serialized bytes (the daemon's request deserializer)."""
    sid = b""
    rid = index = offset = 0
    data = None
    for field, v in _fields(buf, _WRITE_VARINTS, _WRITE_BLOBS):
        if field == 1:
            sid = bytes(buf[v[0]:v[1]])
        elif field == 2:
            rid = v
        elif field == 3:
            index = v & _U32
        elif field == 4:
            offset = v
        else:
            data = v
    try:
        session_id = sid.decode()
    except UnicodeDecodeError:
        raise WireError("session_id is not valid UTF-8") from None
    mv = memoryview(buf)[data[0]:data[1]].toreadonly() if data else _EMPTY
    return WriteChunkView(session_id, rid, index, offset, mv)


# ---------------------------------------------------------------- Match

class MatchReply(NamedTuple):
    """A parsed MatchResponse; `blocks`: its refs (kvkeeper_pb2.BlockRef, or
    columns.Ref when the daemon answered in columns), often none."""

    matched: int
    tiers: List[int]
    lease_id: int
    blocks: Sequence[Any]
    # Another engine's cache holds the leading gpu_matched keys (residency.proto).
    gpu_matched: int = 0
    gpu_engine: str = ""


_KEY_TAG = _varint(2 << 3 | 2)
_FLAGS = (b"\x18\x01", b"\x20\x01", b"\x28\x01")  # fields 3, 4, 5 (bools), when true
_COLUMNS = b"\x30\x01"                              # field 6: refs as BlockColumns


def encode_match_request(session_id: str, keys: Sequence[bytes], key_bytes: int,
                         lease: bool = False, blocks: bool = False,
                         report_use: bool = False) -> bytes:
    """A serialized MatchRequest. keys: bytes; with key_bytes > 0 every key
    must be key_bytes long (the client checked them): then they go in one join."""
    sid = session_id.encode()
    out = [_bytes_field(1, len(sid)), sid]
    if key_bytes and keys:
        prefix = _KEY_TAG + _varint(key_bytes)
        out += (prefix, prefix.join(keys))
    else:
        for k in keys:  # a repeated field writes empty values too
            out += (_KEY_TAG, _varint(len(k)), k)
    out += [field for flag, field in zip((lease, blocks, report_use), _FLAGS) if flag]
    if blocks:
        out.append(_COLUMNS)   # the refs read back as columns.Ref
    return b"".join(out)


def encode_match_response(matched: int, tiers: Sequence[int], lease_id: int,
                          gpu_matched: int = 0, gpu_engine: str = "") -> bytes:
    """A serialized MatchResponse without BlockRefs (tiers: kvkeeper_pb2.Tier values)."""
    if all(0 <= t < 0x80 for t in set(tiers)):
        packed = bytes(tiers)  # one byte per varint
    else:
        packed = b"".join(_varint(t & _U64) for t in tiers)
    out = (_scalar(1, matched & _U32) + _bytes_field(2, len(packed)) + packed
           + _scalar(3, lease_id & _U64))
    if gpu_matched:
        engine = gpu_engine.encode()
        out += _scalar(5, gpu_matched & _U32) + _bytes_field(6, len(engine)) + engine
    return out


def parse_match_response(buf: bytes) -> MatchReply:
    """A MatchResponse from its serialized bytes (the client's response
    deserializer): the canonical layout (fields 1, 2, 3 in order, each at
    most once, one-byte tiers) here, anything else by protobuf."""
    end = len(buf)
    pos = matched = lease_id = 0
    tiers: List[int] = []
    try:
        if pos < end and buf[pos] == 0x08:
            matched, pos = _read_varint(buf, pos + 1, end)
        if pos < end and buf[pos] == 0x12:
            n, pos = _read_varint(buf, pos + 1, end)
            packed = buf[pos:pos + n]
            pos += n
            if pos > end or (packed and max(packed) >= 0x80):
                pos = -1
            tiers = list(packed)
        if 0 <= pos < end and buf[pos] == 0x18:
            lease_id, pos = _read_varint(buf, pos + 1, end)
    except WireError:
        pos = -1
    if pos == end:
        return MatchReply(matched & _U32, tiers, lease_id, ())
    m = pb.MatchResponse.FromString(buf)
    blocks: Sequence[Any] = m.blocks
    if m.HasField("columns"):
        try:
            blocks = refs_of(m.columns)
        except ValueError as e:
            raise WireError(f"MatchResponse: {e}") from None
    return MatchReply(m.matched, list(m.tiers), m.lease_id, blocks, m.gpu_matched,
                      m.gpu_engine)
