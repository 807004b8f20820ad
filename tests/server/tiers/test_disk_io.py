"""The disk tier's load and save fast paths: one-preadv block reads
(fileio.read_block), the lean header parser, and the write order each
filesystem gets (durability.py)."""
from __future__ import annotations

import os
import random
import zlib

import pytest
import xxhash

from disk_helpers import KiB, NS, data, key, open_store, quarantine
from kvkeeper.server.tiers.disk import (CHECKSUM_CRC32, CHECKSUM_XXH3_64, HEADER_BYTES,
                                        HEADER_FIELDS_BYTES, HEADER_STRUCT, MAGIC, CorruptBlock,
                                        DiskStore, pack_header, parse_header)
from kvkeeper.server.tiers.disk import durability as durability_mod
from kvkeeper.server.tiers.disk import fileio
from kvkeeper.server.tiers.disk import store as store_mod
from kvkeeper.server.tiers.disk.durability import (FSYNC_AFTER_RENAME, FSYNC_AND_DIR, NO_SYNC,
                                                   SYNCFS, durability_for)


def reference_parse(raw: bytes):
    """The header format read field by field, as header.py's docstring gives it."""
    (magic, version, hsize, ns, plen, crc, algo, klen, _r16, k, _r32,
     hcrc) = HEADER_STRUCT.unpack(raw)
    if (magic != MAGIC or version != 1 or hsize != HEADER_BYTES or algo not in (1, 2)
            or not 2 <= klen <= 64 or (algo == 1 and crc > 0xFFFFFFFF)
            or zlib.crc32(raw[:124]) != hcrc):
        return None
    return (ns, k[:klen], plen, crc, algo)


def test_parse_header_agrees_with_the_format_on_every_byte_flip():
    for head in (pack_header(NS, key(7), 12345, 0xDEADBEEFCAFE, 2),
                 pack_header(NS, b"ab", 0, 0x1234, CHECKSUM_CRC32)):
        raw = head[:HEADER_FIELDS_BYTES]
        assert tuple(parse_header(raw)) == reference_parse(raw)
        assert tuple(parse_header(memoryview(bytearray(raw)))) == reference_parse(raw)
        for i in range(HEADER_FIELDS_BYTES):
            bad = bytearray(raw)
            bad[i] ^= 0x40
            got = parse_header(bytes(bad))
            assert (None if got is None else tuple(got)) == reference_parse(bytes(bad)), i
    assert parse_header(b"short") is None


SIZES = [300 * KiB, 3 * (1 << 20) + 5000]


@pytest.mark.parametrize("n", SIZES)
def test_short_reads_are_completed(tmp_path, monkeypatch, n):
    """NFS and FUSE may return less than asked mid-file: the loop finishes the read."""
    s = open_store(tmp_path)
    payload = data(n, 4)
    s.write(NS, key(1), payload)
    real = os.preadv
    calls = []

    def dribble(fd, bufs, off):
        calls.append(off)
        first = bufs[0]
        return real(fd, [first[:min(first.nbytes, 1000)]] if first.nbytes else bufs, off)

    monkeypatch.setattr(os, "preadv", dribble)
    out = bytearray(len(payload))
    s.read_into(NS, key(1), out)
    assert out == payload and len(calls) > n // 1000
    assert s.read(NS, key(1)) == payload


@pytest.mark.parametrize("n", [64 * KiB] + SIZES)
def test_one_preadv_per_load_or_per_piece(tmp_path, monkeypatch, n):
    s = open_store(tmp_path)
    s.write(NS, key(1), data(n, 2))
    calls = []

    def counting(name):
        real = getattr(os, name)
        return lambda *a, **kw: (calls.append(name), real(*a, **kw))[1]

    for name in ("preadv", "pread", "fstat", "stat"):
        monkeypatch.setattr(os, name, counting(name))
    s.read_into(NS, key(1), bytearray(n))
    monkeypatch.undo()
    # No separate header read, no size check by stat; one per piece past PIECED_ABOVE.
    pieces = 1 if n <= fileio.PIECED_ABOVE else -(-n // fileio.PIECE_BYTES)
    assert calls == ["preadv"] * pieces


@pytest.mark.parametrize("n", [20000] + SIZES)
@pytest.mark.parametrize("change", ["longer", "shorter", "mid-piece"])
def test_file_size_other_than_its_header_says_is_corrupt(tmp_path, change, n):
    s = open_store(tmp_path)
    payload = data(n, 1)
    s.write(NS, key(1), payload)
    path = s.block_path(NS, key(1))
    if change == "longer":
        with open(path, "ab") as f:
            f.write(b"\0")
    else:
        os.truncate(path, HEADER_BYTES + len(payload) - (1 if change == "shorter" else n // 2))
    with pytest.raises(CorruptBlock, match="size"):
        s.read_into(NS, key(1), bytearray(len(payload)))
    assert s.quarantined == 1 and not os.path.exists(path)


def test_wrong_size_buffer_on_a_truncated_file_is_corruption_not_bad_input(tmp_path):
    s = open_store(tmp_path)
    s.write(NS, key(1), data(9000))
    os.truncate(s.block_path(NS, key(1)), HEADER_BYTES + 100)
    with pytest.raises(CorruptBlock):
        s.read_into(NS, key(1), bytearray(5000))
    s.write(NS, key(2), data(9000))
    with pytest.raises(ValueError, match="holds 5000 bytes, the block 9000"):
        s.read_into(NS, key(2), bytearray(5000))
    assert s.read(NS, key(2)) == data(9000) and len(quarantine(s)) == 1


@pytest.mark.parametrize("n", SIZES)
@pytest.mark.parametrize("algo", [CHECKSUM_CRC32, CHECKSUM_XXH3_64])
def test_a_flipped_bit_anywhere_is_caught_with_either_checksum(tmp_path, n, algo):
    """Files written with CRC32 (earlier daemons) verify; a flipped bit near
    the start, in the middle or in the last byte fails the read."""
    s = open_store(tmp_path)
    payload = data(n, 9)
    value = zlib.crc32(payload) if algo == CHECKSUM_CRC32 else xxhash.xxh3_64_intdigest(payload)
    out = bytearray(n)
    for i, at in enumerate((10, n // 2, n - 1)):
        s.write(NS, key(i), payload, (algo, value))
        assert s.read_into(NS, key(i), out) == (algo, value) and out == payload
        with open(s.block_path(NS, key(i)), "r+b") as f:
            f.seek(HEADER_BYTES + at)
            f.write(bytes([payload[at] ^ 0x80]))
        with pytest.raises(CorruptBlock, match="checksum"):
            s.read_into(NS, key(i), out)
    assert s.checksum_failures == s.quarantined == 3


def test_read_block_reports_without_raising(tmp_path):
    path = str(tmp_path / "f")
    payload = data(5000, 3)
    with open(path, "wb") as f:
        f.write(pack_header(NS, key(1), len(payload), 77, CHECKSUM_CRC32) + payload)
    fd = os.open(path, os.O_RDONLY)
    try:
        h, digest = fileio.read_block(fd, memoryview(bytearray(len(payload))))
        assert h.payload_bytes == len(payload) and digest == zlib.crc32(payload)
        h, digest = fileio.read_block(fd, memoryview(bytearray(10)))     # not its size
        assert h.payload_bytes == len(payload) and digest is None
    finally:
        os.close(fd)


def _block_file(path, payload, algo, extra=b""):
    value = zlib.crc32(payload) if algo == CHECKSUM_CRC32 else xxhash.xxh3_64_intdigest(payload)
    with open(path, "wb") as f:
        f.write(pack_header(NS, key(1), len(payload), value, algo) + payload + extra)
    return value


def _read_block_of(path, nbytes):
    fd = os.open(path, os.O_RDONLY)
    try:
        out = memoryview(bytearray(nbytes))
        h, digest = fileio.read_block(fd, out)
        return h, digest, bytes(out)
    finally:
        os.close(fd)


@pytest.mark.parametrize("algo", [CHECKSUM_XXH3_64, CHECKSUM_CRC32])
@pytest.mark.parametrize("n", [4096, 4097, 4096 + 1000, 3 * 1000 + 17 + 4096])
def test_a_large_payload_read_in_pieces_has_the_whole_payloads_checksum(
        tmp_path, monkeypatch, algo, n):
    """Payloads over PIECED_ABOVE are read and hashed piece by piece (shrunk
    here to 4096 and 1000 bytes): the same bytes and the same checksum as one
    whole read, for every split, the last piece short or not."""
    monkeypatch.setattr(fileio, "PIECED_ABOVE", 4096)
    monkeypatch.setattr(fileio, "PIECE_BYTES", 1000)
    payload = random.Random(n).randbytes(n)
    path = str(tmp_path / "f")
    value = _block_file(path, payload, algo)
    h, digest, got = _read_block_of(path, n)
    assert (h.payload_bytes, h.algo, digest, got) == (n, algo, value, payload)


@pytest.mark.parametrize("algo", [CHECKSUM_XXH3_64, CHECKSUM_CRC32])
def test_a_pieced_read_reports_a_file_of_another_size(tmp_path, monkeypatch, algo):
    """A file one byte longer or shorter than its header says, or read into a
    buffer of another size, gives no checksum: the caller calls it corrupt."""
    monkeypatch.setattr(fileio, "PIECED_ABOVE", 4096)
    monkeypatch.setattr(fileio, "PIECE_BYTES", 1000)
    n = 5500
    payload = random.Random(1).randbytes(n)
    path = str(tmp_path / "f")
    _block_file(path, payload, algo, extra=b"x")
    assert _read_block_of(path, n)[1] is None
    _block_file(path, payload, algo)
    with open(path, "r+b") as f:
        f.truncate(HEADER_BYTES + n - 1)
    assert _read_block_of(path, n)[1] is None
    _block_file(path, payload, algo)
    h, digest, _ = _read_block_of(path, n + 1000)
    assert h.payload_bytes == n and digest is None


def test_a_flipped_bit_in_a_later_piece_fails_the_read(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "PIECED_ABOVE", 4096)
    monkeypatch.setattr(fileio, "PIECE_BYTES", 1000)
    s = open_store(tmp_path)
    payload = random.Random(2).randbytes(6000)
    s.write(NS, key(1), payload)
    out = bytearray(6000)
    s.read_into(NS, key(1), out)
    assert out == payload
    with open(s.block_path(NS, key(1)), "r+b") as f:
        f.seek(HEADER_BYTES + 5500)
        f.write(bytes([payload[5500] ^ 1]))
    with pytest.raises(CorruptBlock, match="checksum"):
        s.read_into(NS, key(1), out)


@pytest.mark.parametrize("fstype,fsync,want", [
    ("ext4", True, FSYNC_AFTER_RENAME), ("xfs", True, FSYNC_AFTER_RENAME),
    ("btrfs", True, FSYNC_AFTER_RENAME), ("nfs4", True, FSYNC_AND_DIR),
    ("fuse.juicefs", True, FSYNC_AND_DIR), ("ext4", False, NO_SYNC)])
def test_durability_for(fstype, fsync, want):
    assert durability_for(fstype, fsync)[0] == want


def test_other_local_filesystems_keep_syncfs():
    how, syncfs = durability_for("tmpfs", True)
    assert (how == SYNCFS and syncfs is not None) or (how == FSYNC_AND_DIR and syncfs is None)


def test_fsync_after_rename_order(tmp_path, monkeypatch):
    """On ext4/XFS/btrfs the block is renamed into place, then fsynced once:
    no fsync before the rename, no directory fsync, and the write returns only
    after that fsync."""
    monkeypatch.setattr(store_mod, "mount_fstype", lambda path: "ext4")
    s, _ = DiskStore.open(str(tmp_path), owner_id="a", fsync=True)
    assert s.durability == FSYNC_AFTER_RENAME and s.syncfs is None
    path = s.block_path(NS, key(1))
    seen = []
    real = os.fsync

    def fsync(fd):
        seen.append(("fsync", os.path.exists(path)))
        real(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    monkeypatch.setattr(durability_mod, "fsync_dir", lambda p: seen.append(("dir", p)))
    s.write(NS, key(1), b"payload")
    assert seen == [("fsync", True)]
    assert s.read(NS, key(1)) == b"payload"


def test_syncfs_order_fsyncs_new_directories(tmp_path, monkeypatch):
    monkeypatch.setattr(store_mod, "mount_fstype", lambda path: "tmpfs")
    s, _ = DiskStore.open(str(tmp_path), owner_id="a", fsync=True)
    if s.durability != SYNCFS:
        pytest.skip("no syncfs(2) here")
    dirs = []
    monkeypatch.setattr(durability_mod, "fsync_dir", dirs.append)
    monkeypatch.setattr(s, "syncfs", lambda d: dirs.append(("syncfs", d)))
    s.write(NS, key(1), b"x")
    s.write(NS, key(1 << 248), b"y")    # another fan-out dir: one more parent fsync
    ns_dir = os.path.dirname(os.path.dirname(s.block_path(NS, key(1))))
    assert dirs[:2] == [s.blocks_dir, ns_dir] and dirs.count(ns_dir) == 2
    assert sum(1 for d in dirs if isinstance(d, tuple)) == 2


class _Memory:
    """A destination tier of plain memory: copy_block reads straight into its view."""

    def __init__(self, n: int) -> None:
        self.buf = bytearray(n)

    def view(self, loc):
        return memoryview(self.buf)


@pytest.mark.parametrize("remote", [False, True])
def test_tier_loads_pin_only_on_network_mounts(tmp_path, monkeypatch, remote):
    """A local file deleted mid-read stays readable through its descriptor, so
    a local load writes no pin file; on a network mount it pins, then unpins."""
    from kvkeeper.server.ledger.disk_index import DiskIndex
    from kvkeeper.server.tiers.disk import RecoveryReport
    from kvkeeper.server.tiers.disk_tier import DiskTier

    s = open_store(tmp_path)
    s.remote = remote
    payload = data(64 * KiB, 6)
    s.write(NS, key(1), payload)
    pins = []
    real_pin = s.pin
    monkeypatch.setattr(s, "pin", lambda *a, **kw: (pins.append(a[:2]), real_pin(*a, **kw))[1])
    tier = DiskTier(s, DiskIndex(1 << 30), write_policy="write-through", admit_after_hits=0,
                    recovery=RecoveryReport(), threads=1)
    try:
        dst = _Memory(len(payload))
        assert tier.read_into(tier.loc(NS, key(1), len(payload)), dst, None)[0] == 2
        assert dst.buf == payload
        assert pins == ([(NS, key(1))] if remote else [])
        assert not s.pinned_by_others(NS, key(1), "someone-else")   # unpinned after
    finally:
        tier.pool.shutdown()


@pytest.mark.parametrize("pieced", [False, True])
@pytest.mark.parametrize("algo", [CHECKSUM_XXH3_64, CHECKSUM_CRC32])
def test_a_scatter_read_has_the_whole_payloads_bytes_and_checksum(tmp_path, monkeypatch,
                                                                   algo, pieced):
    """read_block into a list of buffers (a block's arena extents): the same
    bytes, in order, and checksum as one buffer; also in pieces, where a
    piece spans buffers and a buffer spans pieces."""
    if pieced:
        monkeypatch.setattr(fileio, "PIECED_ABOVE", 4096)
        monkeypatch.setattr(fileio, "PIECE_BYTES", 1000)
    n = 6000
    payload = random.Random(3).randbytes(n)
    path = str(tmp_path / "f")
    value = _block_file(path, payload, algo)
    sizes = [1, 2500, 7, 1990, 1500, 2]
    outs = [memoryview(bytearray(k)) for k in sizes]
    fd = os.open(path, os.O_RDONLY)
    try:
        h, digest = fileio.read_block(fd, outs)
        assert (h.payload_bytes, digest) == (n, value)
        assert b"".join(bytes(o) for o in outs) == payload
        short = [memoryview(bytearray(k)) for k in sizes[:-1]]
        assert fileio.read_block(fd, short)[1] is None     # one buffer fewer: not its size
    finally:
        os.close(fd)


def test_a_scatter_read_in_more_buffers_than_one_preadv_takes(tmp_path, monkeypatch):
    monkeypatch.setattr(fileio, "IOV_MAX", 8)
    n = 100
    payload = random.Random(4).randbytes(n)
    path = str(tmp_path / "f")
    value = _block_file(path, payload, CHECKSUM_XXH3_64)
    outs = [memoryview(bytearray(1)) for _ in range(n)]
    fd = os.open(path, os.O_RDONLY)
    try:
        assert fileio.read_block(fd, outs)[1] == value
    finally:
        os.close(fd)
    assert b"".join(bytes(o) for o in outs) == payload
    with open(path, "ab") as f:
        f.write(b"x")                       # one byte longer than its header says
    fd = os.open(path, os.O_RDONLY)
    try:
        assert fileio.read_block(fd, outs)[1] is None
    finally:
        os.close(fd)


def test_a_gathered_write_in_more_buffers_than_one_pwritev_takes(tmp_path, monkeypatch):
    """write_all over more buffers than IOV_MAX, and through short writes:
    every byte lands once, in order."""
    monkeypatch.setattr(fileio, "IOV_MAX", 8)
    payload = random.Random(5).randbytes(100)
    real = os.pwritev
    calls = []

    def short(fd, bufs, off):   # at most 8 buffers a call; writes at most 7 bytes
        calls.append(len(bufs))
        assert len(bufs) <= 8
        return real(fd, [b"".join(bytes(b) for b in bufs)[:7]], off)

    monkeypatch.setattr(os, "pwritev", short)
    path = str(tmp_path / "f")
    fd = os.open(path, os.O_WRONLY | os.O_CREAT)
    try:
        fileio.write_all(fd, [memoryview(payload)[i:i + 3] for i in range(0, 100, 3)])
    finally:
        os.close(fd)
    assert open(path, "rb").read() == payload and len(calls) == 15
