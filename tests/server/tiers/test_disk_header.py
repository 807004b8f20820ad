"""The block file's header, byte for byte (server/tiers/disk/header.py)."""
from __future__ import annotations

import os
import stat
import struct
import zlib

from disk_helpers import NS, data, open_store
from kvkeeper.server.tiers.disk import FORMAT_VERSION, HEADER_BYTES, MAGIC
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
    plen, crc, algo, klen, r16 = struct.unpack_from("<QQIHH", raw, 32)
    assert (plen, crc, algo, klen, r16) == (1000, zlib.crc32(payload), pb.CHECKSUM_CRC32, 32, 0)
    assert raw[56:88] == k and raw[88:120] == bytes(32)
    assert raw[120:124] == bytes(4)
    assert struct.unpack_from("<I", raw, 124)[0] == zlib.crc32(raw[:124])
    assert raw[128:4096] == bytes(4096 - 128)  # the payload starts page-aligned
    mode = stat.S_IMODE(os.stat(path).st_mode)
    assert mode & ~0o640 == 0  # never more than rw-r-----
