"""A block's value in the cluster, and the Redis key it lives under.

One value per block: a 128-byte header, then the payload (little-endian):

    offset  size  field
    0       8     magic b"KVKCBLK\\x00"
    8       2     format version (u16, = FORMAT_VERSION)
    10      2     key length (u16, 2..64)
    12      4     payload checksum algorithm (u32, as ChecksumAlgo: 2 = XXH3-64, 1 = CRC32)
    16      16    namespace digest
    32      8     payload length (u64)
    40      8     payload checksum (u64; a CRC32 in the low 32 bits)
    48      64    key, zero-padded
    112     12    reserved, zero
    124     4     CRC32 of bytes 0..123 (the header checksum)

The payload checksum is the block's writer's, as committed, else XXH3-64 (the
disk tier's rule, with its constants): a block promoted from the cluster
carries its writer's checksum to its readers. The header names the block, so
a value found under a key is served only for the block it says it is.

The Redis key derives only from the key prefix, the namespace digest and the
key: `<prefix><ns hex>:<key hex>`. No hash tag: each block has its own slot,
so a chain spreads over the masters; the chain probe still costs one
pipelined round trip per node (probe.py). A prefix may not hold `{` or `}`
(that would pin every block to one slot).
"""
from __future__ import annotations

import struct
import zlib
from typing import Any, NamedTuple, Optional

from kvkeeper.client.arena_format import byte_view
from kvkeeper.client.checksum import checksum as payload_checksum

from ..disk import (CHECKSUM_CRC32, MAX_KEY_BYTES, NS_BYTES, PAYLOAD_ALGOS, WRITE_ALGO,
                    CorruptBlock, check_ns_key)

MAGIC = b"KVKCBLK\x00"
FORMAT_VERSION = 1
HEADER_BYTES = 128
# magic, version, key length, algo, ns, payload length, checksum, key, reserved, header crc
HEADER_STRUCT = struct.Struct("<8sHHI16sQQ64s12sI")
assert HEADER_STRUCT.size == HEADER_BYTES
_CRC_AT = HEADER_BYTES - 4
_RESERVED = bytes(12)

Checksum = tuple[int, int]   # (ChecksumAlgo value, checksum), as backend.Checksum


class CorruptValue(CorruptBlock):
    """A value under a block's Redis key that is not that block, intact: a miss
    (the tier deletes it and counts it), never data."""


class Header(NamedTuple):
    ns: bytes
    key: bytes
    payload_bytes: int
    algo: int
    checksum: int


def redis_key(prefix: bytes, ns: bytes, key: bytes) -> bytes:
    """The Redis key of block (ns, key) under `prefix` (ValueError on a bad ns or key)."""
    ns, key = check_ns_key(ns, key)
    return b"%s%s:%s" % (prefix, ns.hex().encode(), key.hex().encode())


def pack_header(ns: bytes, key: bytes, payload_bytes: int, algo: int, checksum: int) -> bytes:
    if algo not in PAYLOAD_ALGOS:
        raise ValueError(f"payload checksum algorithm {algo} is not one of {PAYLOAD_ALGOS}")
    head = HEADER_STRUCT.pack(MAGIC, FORMAT_VERSION, len(key), algo, ns, payload_bytes,
                              checksum, key, _RESERVED, 0)
    return head[:_CRC_AT] + struct.pack("<I", zlib.crc32(head[:_CRC_AT]))


def value_buffer(nbytes: int) -> tuple[bytearray, memoryview]:
    """A buffer for one block's value and the view of its payload part: the
    caller copies the payload in, then seal() writes the header."""
    buf = bytearray(HEADER_BYTES + nbytes)
    return buf, memoryview(buf)[HEADER_BYTES:]


def seal(buf: bytearray, ns: bytes, key: bytes, checksum: Optional[Checksum] = None) -> Checksum:
    """Write the header of the value in `buf` (its payload copied in already).
    `checksum`: the writer's (algo, value) as committed; kept where a header may
    name its algorithm, else the payload is hashed with XXH3-64. Returns what
    the header says."""
    ns, key = check_ns_key(ns, key)
    payload = memoryview(buf)[HEADER_BYTES:]
    if checksum is not None and checksum[0] in PAYLOAD_ALGOS:
        algo, digest = checksum
    else:
        algo, digest = WRITE_ALGO, payload_checksum(WRITE_ALGO, payload)
    buf[:HEADER_BYTES] = pack_header(ns, key, payload.nbytes, algo, digest)
    return algo, digest


def encode(ns: bytes, key: bytes, payload: Any, checksum: Optional[Checksum] = None) -> bytearray:
    """The whole value of a block (a copy of `payload`; tests and tools)."""
    src = byte_view(payload)
    buf, into = value_buffer(src.nbytes)
    into[:] = src
    seal(buf, ns, key, checksum)
    return buf


def parse_header(raw: Any) -> Optional[Header]:
    """The header at the start of `raw`, or None if it is no valid version-1 header."""
    if len(raw) < HEADER_BYTES:
        return None
    (magic, version, klen, algo, ns, plen, digest, key, _res, hcrc) = HEADER_STRUCT.unpack_from(raw)
    if (magic != MAGIC or version != FORMAT_VERSION or algo not in PAYLOAD_ALGOS
            or not 2 <= klen <= MAX_KEY_BYTES or (algo == CHECKSUM_CRC32 and digest > 0xFFFFFFFF)
            or zlib.crc32(memoryview(raw)[:_CRC_AT]) != hcrc):
        return None
    return Header(ns, key[:klen], plen, algo, digest)


def decode(raw: Any, ns: bytes, key: bytes, nbytes: int) -> tuple[memoryview, Checksum]:
    """The payload of block (ns, key) of `nbytes` in value `raw` (a view, no
    copy) and its verified (algo, checksum). CorruptValue saying why when
    `raw` is not that block, whole and intact."""
    view = memoryview(raw)
    h = parse_header(view)
    if h is None:
        raise CorruptValue("not a kvkeeper block value (bad magic, version or header checksum)")
    if h.ns != ns or h.key != key:
        raise CorruptValue(f"the value names block {h.ns.hex()[:8]}/{h.key.hex()[:16]}, "
                           f"not {ns.hex()[:8]}/{key.hex()[:16]}")
    payload = view[HEADER_BYTES:]
    if h.payload_bytes != payload.nbytes or h.payload_bytes != nbytes:
        raise CorruptValue(f"payload of {payload.nbytes} B, header says {h.payload_bytes} B, "
                           f"the block has {nbytes} B")
    if payload_checksum(h.algo, payload) != h.checksum:
        raise CorruptValue("payload checksum mismatch")
    return payload, (h.algo, h.checksum)


def payload_bytes_of(value_bytes: int) -> Optional[int]:
    """The payload size of a value of `value_bytes` (STRLEN), None if it cannot hold one."""
    return value_bytes - HEADER_BYTES if value_bytes > HEADER_BYTES else None


__all__ = ["FORMAT_VERSION", "HEADER_BYTES", "MAGIC", "NS_BYTES", "CorruptValue", "Header",
           "decode", "encode", "pack_header", "parse_header", "payload_bytes_of", "redis_key",
           "seal", "value_buffer"]
