"""Protobuf wire-format pieces for the stub fuzzer: varints of any size and sign,
fields of the wrong wire type, unknown fields and enum values, broken lengths.

Everything here is plain bytes: the fuzzer sends them with identity
serializers, so nothing on the client side validates or re-encodes them.
"""
from __future__ import annotations

import random
from typing import Any, Callable

from google.protobuf.descriptor import FieldDescriptor as FD

U64 = (1 << 64) - 1
VARINT, FIXED64, LEN, SGROUP, EGROUP, FIXED32 = 0, 1, 2, 3, 4, 5

# Numbers a field is most likely to mishandle.
EDGE_INTS = (0, 1, 2, 3, 7, 255, 256, 4095, 4096, 65535, 1 << 20, (1 << 31) - 1, 1 << 31,
             (1 << 32) - 1, 1 << 32, (1 << 53) + 1, (1 << 63) - 1, 1 << 63, U64)
HUGE_OR_NEGATIVE = (-1, -2, -(1 << 31), -(1 << 63), 1 << 32, 1 << 63, U64, (1 << 64) - 2)


def varint(n: int) -> bytes:
    """Base-128 varint; a negative n is written as its 64-bit two's complement (10 bytes)."""
    n &= U64
    out = bytearray()
    while True:
        b = n & 0x7F
        n >>= 7
        if n:
            out.append(b | 0x80)
        else:
            out.append(b)
            return bytes(out)


def tag(num: int, wire_type: int) -> bytes:
    return varint((num << 3) | wire_type)


def field(num: int, wire_type: int, value: Any) -> bytes:
    if wire_type == VARINT:
        return tag(num, VARINT) + varint(value)
    if wire_type == LEN:
        return tag(num, LEN) + varint(len(value)) + value
    if wire_type == FIXED64:
        return tag(num, FIXED64) + (value & U64).to_bytes(8, "little")
    if wire_type == FIXED32:
        return tag(num, FIXED32) + (value & 0xFFFFFFFF).to_bytes(4, "little")
    return tag(num, wire_type)


def wire_type_of(f: Any) -> int:
    if f.type in (FD.TYPE_STRING, FD.TYPE_BYTES, FD.TYPE_MESSAGE):
        return LEN
    if f.type in (FD.TYPE_DOUBLE, FD.TYPE_FIXED64, FD.TYPE_SFIXED64):
        return FIXED64
    if f.type in (FD.TYPE_FLOAT, FD.TYPE_FIXED32, FD.TYPE_SFIXED32):
        return FIXED32
    return VARINT


def _numeric(desc: Any) -> list:
    return [f for f in desc.fields if wire_type_of(f) == VARINT]


def _random_field(rng: random.Random, desc: Any) -> Any:
    return rng.choice(desc.fields) if desc.fields else None


# Each mutation appends to (or rewrites) a serialized message. Appending a scalar
# field overrides the earlier value (last one wins), so a well-formed message
# plus one appended field is a well-formed message with one odd value.
def _huge_varint(rng: random.Random, desc: Any, raw: bytes) -> bytes:
    fields = _numeric(desc)
    num = rng.choice(fields).number if fields else rng.randint(1, 20)
    return raw + field(num, VARINT, rng.choice(HUGE_OR_NEGATIVE + EDGE_INTS))


def _unknown_enum(rng: random.Random, desc: Any, raw: bytes) -> bytes:
    enums = [f for f in desc.fields if f.type == FD.TYPE_ENUM]
    num = rng.choice(enums).number if enums else rng.randint(1, 20)
    return raw + field(num, VARINT, rng.choice((4, 5, 99, 12345, -1, 1 << 31, U64)))


def _wrong_wire_type(rng: random.Random, desc: Any, raw: bytes) -> bytes:
    f = _random_field(rng, desc)
    num = f.number if f is not None else 1
    right = wire_type_of(f) if f is not None else VARINT
    wt = rng.choice([w for w in (VARINT, FIXED64, LEN, FIXED32) if w != right])
    return raw + field(num, wt, rng.randbytes(rng.randint(0, 40)) if wt == LEN
                       else rng.choice(EDGE_INTS))


def _unknown_field(rng: random.Random, desc: Any, raw: bytes) -> bytes:
    num = rng.choice((15, 16, 99, 1000, (1 << 29) - 1))
    wt = rng.choice((VARINT, FIXED64, LEN, FIXED32))
    return raw + field(num, wt, rng.randbytes(rng.randint(0, 64)) if wt == LEN
                       else rng.choice(EDGE_INTS))


def _overlong_varint(rng: random.Random, desc: Any, raw: bytes) -> bytes:
    f = _random_field(rng, desc)
    return raw + tag(f.number if f else 1, VARINT) + b"\xff" * rng.randint(10, 20) + b"\x01"


def _length_overrun(rng: random.Random, desc: Any, raw: bytes) -> bytes:
    f = _random_field(rng, desc)
    body = rng.randbytes(rng.randint(0, 8))
    return raw + tag(f.number if f else 1, LEN) + varint(len(body) + rng.randint(1, 1 << 20)) + body


def _bad_utf8(rng: random.Random, desc: Any, raw: bytes) -> bytes:
    strings = [f for f in desc.fields if f.type == FD.TYPE_STRING]
    num = rng.choice(strings).number if strings else 1
    return raw + field(num, LEN, rng.choice((b"\xff", b"\xc3\x28", b"ab\xed\xa0\x80", b"\xf8\x88\x80\x80\x80")))


def _bad_tag(rng: random.Random, desc: Any, raw: bytes) -> bytes:
    # Field number 0, wire types 6 and 7, and unbalanced group markers.
    return raw + rng.choice((tag(0, VARINT) + b"\x01", tag(1, 6), tag(2, 7), tag(3, EGROUP),
                             tag(4, SGROUP) + b"\x08\x01", varint(U64)))


def _nested_garbage(rng: random.Random, desc: Any, raw: bytes) -> bytes:
    msgs = [f for f in desc.fields if f.type == FD.TYPE_MESSAGE]
    if not msgs:
        return raw + field(rng.randint(1, 12), LEN, rng.randbytes(rng.randint(1, 30)))
    inner = rng.choice((rng.randbytes(rng.randint(1, 30)), b"\x08" + b"\xff" * 12, b"\x2a\x05ab"))
    return raw + field(rng.choice(msgs).number, LEN, inner)


def _packed(rng: random.Random, desc: Any, raw: bytes) -> bytes:
    rep = [f for f in desc.fields if f.is_repeated and wire_type_of(f) == VARINT]
    num = rng.choice(rep).number if rep else rng.randint(1, 8)
    values = [rng.choice(EDGE_INTS + HUGE_OR_NEGATIVE) for _ in range(rng.randint(0, 50))]
    body = b"".join(varint(v) for v in values)
    if rng.random() < 0.3:
        body += b"\x80"   # a varint cut short inside the packed run
    return raw + field(num, LEN, body)


def _duplicate(rng: random.Random, desc: Any, raw: bytes) -> bytes:
    return raw + raw[:rng.randint(0, len(raw))] if raw else raw


WIRE_MUTATIONS: dict[str, Callable[[random.Random, Any, bytes], bytes]] = {
    "huge-varint": _huge_varint, "unknown-enum": _unknown_enum,
    "wrong-wire-type": _wrong_wire_type, "unknown-field": _unknown_field,
    "overlong-varint": _overlong_varint, "length-overrun": _length_overrun,
    "bad-utf8": _bad_utf8, "bad-tag": _bad_tag, "nested-garbage": _nested_garbage,
    "packed": _packed, "duplicate": _duplicate,
}


def truncate(rng: random.Random, raw: bytes) -> bytes:
    return raw[:rng.randint(0, max(0, len(raw) - 1))] if raw else b"\x0a"


def bitflip(rng: random.Random, raw: bytes) -> bytes:
    if not raw:
        return bytes([rng.randint(0, 255)])
    b = bytearray(raw)
    for _ in range(rng.randint(1, 4)):
        b[rng.randrange(len(b))] ^= 1 << rng.randrange(8)
    return bytes(b)


def random_bytes(rng: random.Random) -> bytes:
    n = rng.choice((1, 2, 3, 5, 16, 64, 300, 4096))
    return rng.randbytes(n)
