"""The block file's header: its byte layout, packing, parsing, and the limits
on the namespace and key it names.

Block file format (little-endian), then the payload:

    offset  size  field
    0       8     magic b"KVKBLOCK"
    8       4     format version (u32, = FORMAT_VERSION)
    12      4     header size (u32, = HEADER_BYTES = 4096; the payload starts here)
    16      16    namespace digest
    32      8     payload length (u64)
    40      8     payload checksum (u64; a CRC32 in the low 32 bits)
    48      4     checksum algorithm (u32, as ChecksumAlgo in the API: 2 = XXH3-64,
                  1 = CRC32: what earlier daemons wrote, and older clients commit)
    52      2     key length (u16, 2..64)
    54      2     reserved, zero
    56      64    key, zero-padded
    120     4     reserved, zero
    124     4     CRC32 of bytes 0..123 (the header checksum)
    128     3968  zero (reserved)

A file's size is exactly HEADER_BYTES + payload length. The payload starts at
4096 so that it is page-aligned in the file: O_DIRECT and GPUDirect Storage
reads need that, and since KV blocks are multiples of 4 KiB the header costs
exactly one filesystem block, as a 128-byte header pushing the payload's tail
into one more block would too. Start-up reads only the first 128 bytes.

The payload checksum is the block's writer's, as committed (DiskStore.write),
else XXH3-64 (memory speed; `kvkeeper bench checksum`); files written with
CRC32 stay readable and are verified with it.
A daemon older than XXH3 support rejects an XXH3 file's header (quarantines
it as corrupt: a miss, never bad data), so upgrade every daemon sharing a
directory before new files are written. The header's own checksum stays
CRC32: it covers 124 bytes.
"""
from __future__ import annotations

import struct
import zlib
from typing import Any, NamedTuple

MAGIC = b"KVKBLOCK"
FORMAT_VERSION = 1
HEADER_BYTES = 4096         # where the payload starts: page-aligned (see the docstring)
HEADER_FIELDS_BYTES = 128  # the fields; the rest of the header is zero
CHECKSUM_CRC32 = 1    # the API's ChecksumAlgo.CHECKSUM_CRC32
CHECKSUM_XXH3_64 = 2  # the API's ChecksumAlgo.CHECKSUM_XXH3_64
PAYLOAD_ALGOS = (CHECKSUM_CRC32, CHECKSUM_XXH3_64)  # what a header may name
WRITE_ALGO = CHECKSUM_XXH3_64                       # what new files use
NS_BYTES = 16
MIN_KEY_BYTES, MAX_KEY_BYTES = 2, 64
# magic, version, header size, ns, payload length, checksum, algo, key length,
# reserved u16, key, reserved u32, header crc
HEADER_STRUCT = struct.Struct("<8sII16sQQIHH64sII")
assert HEADER_STRUCT.size == HEADER_FIELDS_BYTES
_HEADER_CRC_AT = HEADER_FIELDS_BYTES - 4
_HEADER_PAD = bytes(HEADER_BYTES - HEADER_FIELDS_BYTES)
# What every valid header starts with (magic, version, header size), and the
# fields after it: parse_header compares the one and unpacks the other.
_PREFIX = struct.pack("<8sII", MAGIC, FORMAT_VERSION, HEADER_BYTES)
_PREFIX_BYTES = len(_PREFIX)
_FIELDS_AFTER_PREFIX = struct.Struct("<" + HEADER_STRUCT.format[len("<8sII"):])
assert _PREFIX_BYTES + _FIELDS_AFTER_PREFIX.size == HEADER_FIELDS_BYTES


def pack_header(ns: bytes, key: bytes, payload_bytes: int, checksum: int,
                algo: int = WRITE_ALGO) -> bytes:
    """The header of a block file whose payload has `checksum` under `algo`."""
    if algo not in PAYLOAD_ALGOS:
        raise ValueError(f"payload checksum algorithm {algo} is not one of {PAYLOAD_ALGOS}")
    head = HEADER_STRUCT.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, ns, payload_bytes, checksum,
                              algo, len(key), 0, key, 0, 0)
    return (head[:_HEADER_CRC_AT] + struct.pack("<I", zlib.crc32(head[:_HEADER_CRC_AT]))
            + _HEADER_PAD)


class Header(NamedTuple):
    ns: bytes
    key: bytes
    payload_bytes: int
    checksum: int
    algo: int       # CHECKSUM_CRC32 or CHECKSUM_XXH3_64: how `checksum` was computed


_new_header = tuple.__new__   # Header(*fields) without its generated __new__ (a Python call)


def parse_header(raw: bytes | memoryview) -> Header | None:
    """The header in `raw` (HEADER_FIELDS_BYTES of a file's start), or None if
    it is not a valid version-1 header. On every load and for every file at
    start-up, so it is lean: the fixed prefix is compared as bytes and the
    tuple is built without the NamedTuple's Python-level __new__."""
    if len(raw) != HEADER_FIELDS_BYTES or raw[:_PREFIX_BYTES] != _PREFIX:
        return None
    ns, plen, crc, algo, klen, _r16, key, _r32, hcrc = _FIELDS_AFTER_PREFIX.unpack_from(
        raw, _PREFIX_BYTES)
    if (algo not in PAYLOAD_ALGOS or not MIN_KEY_BYTES <= klen <= MAX_KEY_BYTES
            or (algo == CHECKSUM_CRC32 and crc > 0xFFFFFFFF)
            or zlib.crc32(raw[:_HEADER_CRC_AT]) != hcrc):
        return None
    return _new_header(Header, (ns, key[:klen], plen, crc, algo))


def check_ns_key(ns: Any, key: Any) -> tuple[bytes, bytes]:
    """ns and key as bytes, or ValueError: only their hex ever reaches a path."""
    if (type(ns) is bytes and type(key) is bytes and len(ns) == NS_BYTES
            and MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES):
        return ns, key   # the usual case, on every read and write: no copies
    if not isinstance(ns, (bytes, bytearray)) or len(ns) != NS_BYTES:
        raise ValueError(f"namespace must be {NS_BYTES} bytes, got {type(ns).__name__} "
                         f"of length {len(ns) if isinstance(ns, (bytes, bytearray)) else '?'}")
    if not isinstance(key, (bytes, bytearray)) or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes, got "
                         f"{type(key).__name__} of length "
                         f"{len(key) if isinstance(key, (bytes, bytearray)) else '?'}")
    return bytes(ns), bytes(key)
