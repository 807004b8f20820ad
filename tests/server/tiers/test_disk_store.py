"""DiskStore (server/tiers/disk/store.py): reads and writes, accounting, corruption,
full disks and I/O errors, several daemons on one directory."""
from __future__ import annotations

import errno
import os
import shutil
import subprocess
import threading
import uuid

import pytest

from disk_helpers import KiB, NS, NS2, data, key, open_store, quarantine
from kvkeeper.server.tiers.disk import (HEADER_BYTES, CorruptBlock, DiskFull, DiskIOError,
                                        DiskStore, NotStored)


def test_empty_payload_and_reads(tmp_path):
    s = open_store(tmp_path)
    s.write(NS, key(1), b"")
    assert s.read(NS, key(1)) == b""
    s.read_into(NS, key(1), bytearray(0))
    out = bytearray(5)
    s.write(NS, key(2), b"hello")
    s.read_into(NS, key(2), out)
    assert out == b"hello" and s.read(NS, key(2)) == b"hello"
    with pytest.raises(ValueError):
        s.read_into(NS, key(2), bytearray(4))
    assert s.bytes_read == 10 and s.bytes_written == 2 * HEADER_BYTES + 5


def test_accounting(tmp_path):
    s = open_store(tmp_path)
    assert (len(s), s.used_bytes) == (0, 0)
    s.write(NS, key(1), bytes(100))
    s.write(NS, key(2), bytes(50))
    s.write(NS, key(1), bytes(10))          # overwrite with another size
    assert (len(s), s.used_bytes) == (2, 2 * HEADER_BYTES + 60)
    assert sorted(s.iter_index()) == [(NS, key(1), 10), (NS, key(2), 50)]
    assert s.delete(NS, key(1)) == HEADER_BYTES + 10
    assert s.delete(NS, key(1)) == 0
    assert (len(s), s.used_bytes) == (1, HEADER_BYTES + 50)
    st = os.statvfs(str(tmp_path))
    assert abs(s.fs_free_bytes() - st.f_bavail * st.f_frsize) < (64 << 20)  # others write too
    assert not s.contains(NS, key(1)) and s.contains(NS, key(2))
    assert not s.contains(NS2, key(2))  # namespaces are separate


def test_corrupt_payload_is_a_miss_and_quarantined(tmp_path):
    s = open_store(tmp_path)
    payload = data(64 * KiB, 5)
    s.write(NS, key(1), payload)
    path = s.block_path(NS, key(1))
    with open(path, "r+b") as f:
        f.seek(HEADER_BYTES + 12345)
        f.write(bytes([payload[12345] ^ 0x01]))
    with pytest.raises(CorruptBlock, match="quarantine"):
        s.read_into(NS, key(1), bytearray(64 * KiB))
    assert (s.checksum_failures, s.quarantined) == (1, 1)
    assert not os.path.exists(path) and not s.contains(NS, key(1))
    [q] = quarantine(s)
    assert q.startswith(f"{NS.hex()[:16]}.{key(1).hex()}.kvb.")
    assert os.path.getsize(os.path.join(s.quarantine_dir, q)) == HEADER_BYTES + 64 * KiB
    with pytest.raises(NotStored):
        s.read(NS, key(1))
    assert (len(s), s.used_bytes) == (0, 0)
    s.write(NS, key(1), payload)  # a fresh copy is fine again
    assert s.read(NS, key(1)) == payload


def test_truncated_after_open_fails_on_read(tmp_path):
    s = open_store(tmp_path)
    s.write(NS, key(1), data(9000))
    os.truncate(s.block_path(NS, key(1)), HEADER_BYTES + 100)
    with pytest.raises(CorruptBlock):
        s.read(NS, key(1))
    assert s.quarantined == 1 and s.checksum_failures == 1


def test_wrong_block_under_a_name_fails_on_read(tmp_path):
    s = open_store(tmp_path)
    s.write(NS, key(1), b"one")
    s.write(NS, key(2), b"two")
    shutil.copy(s.block_path(NS, key(2)), s.block_path(NS, key(1)))
    with pytest.raises(CorruptBlock):
        s.read(NS, key(1))
    assert s.read(NS, key(2)) == b"two"


def test_namespace_prefix_collision_is_a_miss_not_corruption(tmp_path):
    s = open_store(tmp_path)
    twin = NS[:8] + bytes(8)  # same first 64 bits: same directory
    s.write(twin, key(1), b"twin's")
    with pytest.raises(NotStored):
        s.read(NS, key(1))
    assert s.quarantined == 0 and s.read(twin, key(1)) == b"twin's"


def test_verify_all(tmp_path):
    s = open_store(tmp_path)
    for i in range(20):
        s.write(NS, key(i), data(2000 + i, i))
    with open(s.block_path(NS, key(7)), "r+b") as f:
        f.seek(HEADER_BYTES + 3)
        f.write(b"\x00\x00")
    os.unlink(s.block_path(NS, key(8)))  # e.g. deleted by another daemon
    seen = []
    rep = s.verify_all(progress=lambda done, total: seen.append((done, total)))
    assert (rep.checked, rep.corrupt, rep.missing) == (18, 1, 1)
    assert seen[-1] == (20, 20) and len(seen) == 20
    assert len(quarantine(s)) == 1 and len(s) == 18


@pytest.fixture
def small_tmpfs():
    """A 2 MiB tmpfs, when this process may mount one (root with CAP_SYS_ADMIN)."""
    mnt = f"/tmp/kvk-tmpfs-{uuid.uuid4().hex[:8]}"
    os.makedirs(mnt)
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", mnt],
                       capture_output=True, check=False)
    if r.returncode != 0:
        os.rmdir(mnt)
        pytest.skip(f"cannot mount a tmpfs here ({r.stderr.decode().strip()}); "
                    "test_enospc_simulated covers the error path")
    yield mnt
    subprocess.run(["umount", mnt], check=False)
    os.rmdir(mnt)


def test_enospc_on_a_real_small_tmpfs(small_tmpfs):
    s = open_store(small_tmpfs, fsync=True)
    block = data(256 * KiB, 1)
    written = []
    with pytest.raises(DiskFull) as exc:
        for i in range(100):
            s.write(NS, key(i), block)
            written.append(i)
    msg = str(exc.value)
    assert "full" in msg and "free" in msg and "Nothing was stored" in msg
    assert exc.value.errno == errno.ENOSPC
    assert 3 <= len(written) < 8
    assert os.listdir(s.tmp_dir) == []                  # no tmp file left
    assert s.io_errors == 1 and len(s) == len(written)
    assert s.used_bytes == len(written) * (HEADER_BYTES + len(block))
    assert not s.contains(NS, key(len(written)))
    for i in written:                                   # reads go on
        assert s.read(NS, key(i)) == block
    s.delete(NS, key(0))
    s.write(NS, key(999), block)                        # room again after a delete
    _, rep = DiskStore.open(small_tmpfs, owner_id="a")
    assert rep.blocks == len(written) and rep.quarantined == 0


@pytest.mark.parametrize("where", ["pwritev", "fsync", "replace"])
@pytest.mark.parametrize("err,exc_type", [(errno.ENOSPC, DiskFull), (errno.EDQUOT, DiskFull),
                                          (errno.EIO, DiskIOError)])
def test_enospc_simulated(tmp_path, monkeypatch, where, err, exc_type):
    s = open_store(tmp_path, fsync=True)
    s.write(NS, key(1), b"before")

    def fail(*a, **kw):
        raise OSError(err, os.strerror(err))

    monkeypatch.setattr(os, where, fail)
    if where == "fsync" and s.syncfs is not None:
        # On a local filesystem durability comes from one syncfs, not per-file fsync.
        monkeypatch.setattr(s, "syncfs", fail)
    with pytest.raises(exc_type) as exc:
        s.write(NS, key(2), data(5000))
    monkeypatch.undo()
    assert type(exc.value) is exc_type and exc.value.errno == err
    if exc_type is DiskFull:
        assert "is full" in str(exc.value)
    assert os.listdir(s.tmp_dir) == [] and s.io_errors == 1
    assert not s.contains(NS, key(2)) and s.read(NS, key(1)) == b"before"


def test_min_free_bytes_refuses_before_writing(tmp_path):
    free = os.statvfs(str(tmp_path)).f_bavail * os.statvfs(str(tmp_path)).f_frsize
    s = open_store(tmp_path, min_free_bytes=free + (1 << 30))
    with pytest.raises(DiskFull, match="min_free_bytes"):
        s.write(NS, key(1), b"x")
    assert os.listdir(s.tmp_dir) == [] and len(s) == 0


def test_read_eio_is_disk_io_error(tmp_path, monkeypatch):
    s = open_store(tmp_path)
    s.write(NS, key(1), b"abc")

    def fail(*a, **kw):
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(os, "pread", fail)
    with pytest.raises(DiskIOError) as exc:
        s.read(NS, key(1))
    assert not isinstance(exc.value, DiskFull) and s.io_errors == 1
    monkeypatch.undo()
    assert s.read(NS, key(1)) == b"abc" and s.quarantined == 0


def test_same_key_from_many_threads(tmp_path):
    s = open_store(tmp_path)
    versions = [data(10_000 + i, i) for i in range(8)]

    def hammer(v: bytes) -> None:
        for _ in range(20):
            s.write(NS, key(1), v)
            assert s.read(NS, key(1)) in versions

    threads = [threading.Thread(target=hammer, args=(v,)) for v in versions]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert s.read(NS, key(1)) in versions and len(s) == 1
    assert s.used_bytes == HEADER_BYTES + len(s.read(NS, key(1)))
    assert os.listdir(s.tmp_dir) == []


def test_block_written_by_a_is_found_by_b(tmp_path):
    a = open_store(tmp_path, owner="host-a")
    b = open_store(tmp_path, owner="host-b")    # opened before A wrote: index empty
    a.write(NS, key(1), b"from a")
    assert len(b) == 0
    assert b.contains(NS, key(1))               # index miss -> the file
    assert len(b) == 1 and b.used_bytes == HEADER_BYTES + 6
    assert b.indexed_bytes(NS, key(1)) == 6 and b.indexed_bytes(NS, key(9)) is None
    assert b.read(NS, key(1)) == b"from a"
    out = bytearray(6)
    a.write(NS, key(2), b"second")
    b.read_into(NS, key(2), out)                # read without contains first
    assert out == b"second" and len(b) == 2
    a.delete(NS, key(1))                        # B's entry is now stale
    assert b.contains(NS, key(1))
    with pytest.raises(NotStored):
        b.read(NS, key(1))
    assert not b.contains(NS, key(1)) and len(b) == 1


def test_a_writers_checksum_is_kept_and_checked(tmp_path):
    """write(checksum=(algo, value)) keeps the writer's checksum as the file's
    (no second hash); read_into returns it; a wrong one makes the read fail."""
    import zlib

    import xxhash

    from kvkeeper.v1 import kvkeeper_pb2 as pb

    s = open_store(tmp_path)
    payload = data(64 * KiB, 3)
    xxh = xxhash.xxh3_64_intdigest(payload)
    s.write(NS, key(1), payload, (pb.CHECKSUM_XXH3_64, xxh))
    s.write(NS, key(2), payload, (pb.CHECKSUM_CRC32, zlib.crc32(payload)))
    s.write(NS, key(3), payload)                              # none given: XXH3 of the payload
    s.write(NS, key(4), payload, (pb.CHECKSUM_NONE, 0))       # none to keep: likewise
    out = bytearray(64 * KiB)
    assert s.read_into(NS, key(1), out) == (pb.CHECKSUM_XXH3_64, xxh) and out == payload
    assert s.read_into(NS, key(2), out) == (pb.CHECKSUM_CRC32, zlib.crc32(payload))
    assert s.read_into(NS, key(3), out) == s.read_into(NS, key(4), out) == (pb.CHECKSUM_XXH3_64, xxh)
    s.write(NS, key(5), payload, (pb.CHECKSUM_XXH3_64, xxh ^ 1))   # not these bytes' checksum
    with pytest.raises(CorruptBlock):
        s.read_into(NS, key(5), out)
    assert s.checksum_failures == 1
