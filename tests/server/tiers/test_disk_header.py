"""The block file's header, byte for byte (server/tiers/disk/header.py)."""
from __future__ import annotations

import os
import stat
import struct
import zlib

import pytest
import xxhash

from disk_helpers import KiB, NS, data, key, open_store
from kvkeeper.server.tiers.disk import (CHECKSUM_CRC32, FORMAT_VERSION, HEADER_BYTES, MAGIC,
                                        CorruptBlock, DiskStore, pack_header, parse_header)
from kvkeeper.v1 import kvkeeper_pb2 as pb


def test_header_layout(tmp_path):
    s = open_store(tmp_path)
    k = bytes(range(1, 33))
    payload = data(1000, 3)
    assert s.write(NS, k, payload) == HEADER_BYTES + 1000
    path = s.block_path(NS, k)
    with open(path, "rb") as f:
        raw = f.read()
    assert len(raw) == HEADER_BYTES + 1000 and raw[HEADER_BYTES:] == payload
    assert raw[0:8] == MAGIC == b"KVKBLOCK"
    version, hsize = struct.unpack_from("<II", raw, 8)
    assert (version, hsize) == (FORMAT_VERSION, HEADER_BYTES) == (1, 4096)
    assert raw[16:32] == NS
    plen, digest, algo, klen, r16 = struct.unpack_from("<QQIHH", raw, 32)
    assert (plen, digest, algo, klen, r16) == (1000, xxhash.xxh3_64_intdigest(payload),
                                              pb.CHECKSUM_XXH3_64, 32, 0)
    assert raw[56:88] == k and raw[88:120] == bytes(32)
    assert raw[120:124] == bytes(4)
    assert struct.unpack_from("<I", raw, 124)[0] == zlib.crc32(raw[:124])
    assert raw[128:4096] == bytes(4096 - 128)  # the payload starts page-aligned
    mode = stat.S_IMODE(os.stat(path).st_mode)
    assert mode & ~0o640 == 0  # never more than rw-r-----


def write_crc32_file(store: DiskStore, k: bytes, payload: bytes) -> str:
    """A block file as daemons before XXH3 wrote it (algo 1, CRC32 of the payload)."""
    path = store.block_path(NS, k)
    os.makedirs(os.path.dirname(path), exist_ok=True)
    head = pack_header(NS, k, len(payload), zlib.crc32(payload), CHECKSUM_CRC32)
    assert struct.unpack_from("<I", head, 48)[0] == 1
    with open(path, "wb") as f:
        f.write(head + payload)
    return path


def test_crc32_files_stay_readable(tmp_path):
    s = open_store(tmp_path)
    payload = data(64 * KiB, 9)
    write_crc32_file(s, key(1), payload)
    s2 = open_store(tmp_path, owner="b")   # found by the start-up scan, from the header
    assert s2.contains(NS, key(1))
    out = bytearray(64 * KiB)
    s2.read_into(NS, key(1), out)
    assert out == payload and s2.checksum_failures == 0


def test_corrupt_crc32_file_is_refused(tmp_path):
    s = open_store(tmp_path)
    payload = data(64 * KiB, 9)
    path = write_crc32_file(s, key(1), payload)
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 777)
        f.write(bytes([payload[777] ^ 0x10]))
    s2 = open_store(tmp_path, owner="b")
    with pytest.raises(CorruptBlock):
        s2.read(NS, key(1))
    assert s2.checksum_failures == 1 and not os.path.exists(path)


def test_header_checksum_algorithms(tmp_path):
    h = pack_header(NS, key(1), 10, (1 << 64) - 1)   # XXH3 uses all 64 bits
    assert parse_header(h[:128]).algo == pb.CHECKSUM_XXH3_64
    # CRC32 values fit in 32 bits: a wider one is a bad header, as before.
    assert parse_header(pack_header(NS, key(1), 10, 1 << 32, CHECKSUM_CRC32)[:128]) is None
    with pytest.raises(ValueError, match="algorithm"):
        pack_header(NS, key(1), 10, 0, pb.CHECKSUM_NONE)
    forged = bytearray(h[:128])
    struct.pack_into("<I", forged, 48, 7)   # an algorithm no daemon writes
    struct.pack_into("<I", forged, 124, zlib.crc32(bytes(forged[:124])))
    assert parse_header(bytes(forged)) is None
