"""The cluster value format: round trips, every corruption caught, key naming."""
from __future__ import annotations

import struct

import numpy as np
import pytest
import xxhash
import zlib

from kvkeeper.server.tiers.cluster import format as fmt
from kvkeeper.server.tiers.disk import CHECKSUM_CRC32, CHECKSUM_XXH3_64, CorruptBlock

NS = bytes(range(16))
KEY = bytes(range(100, 132))


def rand(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


@pytest.mark.parametrize("n", [1, 4095, 4096, 65536 + 3, 1 << 20])
def test_round_trip_hashes_with_xxh3_without_a_writer_checksum(n):
    data = rand(n, n)
    raw = bytes(fmt.encode(NS, KEY, data))
    assert len(raw) == fmt.HEADER_BYTES + n
    payload, kept = fmt.decode(raw, NS, KEY, n)
    assert bytes(payload) == data
    assert kept == (CHECKSUM_XXH3_64, xxhash.xxh3_64_intdigest(data))


@pytest.mark.parametrize("algo,fn", [(CHECKSUM_XXH3_64, xxhash.xxh3_64_intdigest),
                                     (CHECKSUM_CRC32, zlib.crc32)])
def test_the_writers_checksum_is_kept(algo, fn):
    data = rand(5000, 1)
    raw = fmt.encode(NS, KEY, data, (algo, fn(data)))
    assert fmt.decode(raw, NS, KEY, 5000)[1] == (algo, fn(data))
    # A checksum algorithm the header cannot name (NONE = 0): the payload is hashed.
    raw = fmt.encode(NS, KEY, data, (0, 0))
    assert fmt.decode(raw, NS, KEY, 5000)[1] == (CHECKSUM_XXH3_64, xxhash.xxh3_64_intdigest(data))


def test_a_wrong_writer_checksum_makes_the_value_unreadable():
    data = rand(300, 2)
    raw = fmt.encode(NS, KEY, data, (CHECKSUM_XXH3_64, xxhash.xxh3_64_intdigest(data) ^ 1))
    with pytest.raises(fmt.CorruptValue, match="checksum"):
        fmt.decode(raw, NS, KEY, 300)


@pytest.mark.parametrize("at", [0, 8, 10, 12, 16, 31, 32, 40, 48, 111, 124, 127,
                                fmt.HEADER_BYTES, fmt.HEADER_BYTES + 777])
def test_any_flipped_bit_is_caught(at):
    n = 1000
    raw = fmt.encode(NS, KEY, rand(n, 3))
    raw[at] ^= 0x10
    with pytest.raises(fmt.CorruptValue):
        fmt.decode(raw, NS, KEY, n)


def test_the_value_of_another_block_is_not_served():
    raw = fmt.encode(NS, KEY, rand(64, 4))
    other_key = KEY[:-1] + b"\x00"
    with pytest.raises(fmt.CorruptValue, match="names block"):
        fmt.decode(raw, NS, other_key, 64)
    with pytest.raises(fmt.CorruptValue, match="names block"):
        fmt.decode(raw, bytes(16), KEY, 64)


@pytest.mark.parametrize("cut", [1, 63, 64 + fmt.HEADER_BYTES - 1])
def test_truncated_or_short_values_are_corrupt(cut):
    raw = bytes(fmt.encode(NS, KEY, rand(64, 5)))
    with pytest.raises(fmt.CorruptValue):
        fmt.decode(raw[:-cut], NS, KEY, 64)


def test_a_block_of_another_size_is_corrupt():
    raw = fmt.encode(NS, KEY, rand(64, 6))
    with pytest.raises(fmt.CorruptValue, match="the block has 65"):
        fmt.decode(raw, NS, KEY, 65)
    with pytest.raises(fmt.CorruptValue):
        fmt.decode(bytes(raw) + b"x", NS, KEY, 64)


def test_garbage_and_empty_values_are_corrupt_and_a_corrupt_block():
    for raw in (b"", b"hello", bytes(fmt.HEADER_BYTES + 10), rand(500, 7)):
        with pytest.raises(CorruptBlock):   # the stack treats it as a corrupt miss
            fmt.decode(raw, NS, KEY, 10)


def test_header_layout_is_as_documented():
    data = rand(77, 8)
    raw = bytes(fmt.encode(NS, KEY, data))
    magic, version, klen, algo = struct.unpack_from("<8sHHI", raw)
    assert (magic, version, klen, algo) == (fmt.MAGIC, fmt.FORMAT_VERSION, 32, CHECKSUM_XXH3_64)
    assert raw[16:32] == NS and raw[48:80] == KEY and raw[80:124] == bytes(44)
    assert struct.unpack_from("<QQ", raw, 32) == (77, xxhash.xxh3_64_intdigest(data))
    assert struct.unpack_from("<I", raw, 124)[0] == zlib.crc32(raw[:124])
    assert fmt.parse_header(raw) == fmt.Header(NS, KEY, 77, CHECKSUM_XXH3_64,
                                               xxhash.xxh3_64_intdigest(data))


def test_redis_key_is_prefix_ns_and_key_hex_only():
    assert fmt.redis_key(b"kvk:", NS, KEY) == b"kvk:" + NS.hex().encode() + b":" + KEY.hex().encode()
    assert fmt.redis_key(b"", NS, b"ab") == NS.hex().encode() + b":6162"
    for ns, key in ((b"short", KEY), (NS, b"k"), (NS, bytes(65)), ("x" * 16, KEY)):
        with pytest.raises(ValueError):
            fmt.redis_key(b"kvk:", ns, key)


def test_payload_size_of_a_strlen():
    assert fmt.payload_bytes_of(fmt.HEADER_BYTES + 5) == 5
    assert fmt.payload_bytes_of(fmt.HEADER_BYTES) is None
    assert fmt.payload_bytes_of(0) is None
