"""Disk tier: paths, file format, crash recovery, corruption, full disks,
several daemons on one directory (pins, GC lock)."""
from __future__ import annotations

import errno
import hashlib
import os
import shutil
import signal
import stat
import struct
import subprocess
import sys
import textwrap
import threading
import time
import uuid
import zlib

import pytest

from kvkeeper.server.tiers.disk import recovery as recovery_mod
from kvkeeper.server.tiers.disk import (FORMAT_VERSION, HEADER_BYTES, MAGIC, CorruptBlock,
                                        DiskFull, DiskIOError, DiskStore, GcLock, NotStored)
from kvkeeper.v1 import kvkeeper_pb2 as pb

KiB = 1 << 10
NS = bytes.fromhex("00112233445566778899aabbccddeeff")
NS2 = bytes.fromhex("ffeeddccbbaa99887766554433221100")


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def data(n: int, seed: int = 0) -> bytes:
    return bytes((i * 131 + seed * 7 + 1) & 0xFF for i in range(n)) if n < 4096 else \
        (bytes(range(256)) * (n // 256 + 1))[seed % 256:seed % 256 + n]


def open_store(root, owner="a", **kw):
    kw.setdefault("fsync", False)
    store, _ = DiskStore.open(str(root), owner_id=owner, **kw)
    return store


def quarantine(store):
    return sorted(os.listdir(store.quarantine_dir))


# ---------------------------------------------------------------- paths and format

def test_path_is_only_hex(tmp_path):
    s = open_store(tmp_path)
    k = bytes(range(200, 232))
    rel = os.path.relpath(s.block_path(NS, k), s.root).split(os.sep)
    assert rel == ["blocks", NS.hex()[:16], k.hex()[:2], k.hex() + ".kvb"]
    s.write(NS, k, b"x")
    assert os.path.exists(s.block_path(NS, k))


@pytest.mark.parametrize("ns,k", [
    (b"short", key(1)), (NS + b"x", key(1)), ("00" * 16, key(1)), (NS, "00" * 32),
    (NS, b"\x01"), (NS, bytes(65)), (NS, None), (memoryview(NS), key(1)),
])
def test_bad_ns_or_key_never_reach_a_path(tmp_path, ns, k):
    s = open_store(tmp_path)
    for call in (lambda: s.write(ns, k, b"x"), lambda: s.read(ns, k),
                 lambda: s.contains(ns, k), lambda: s.delete(ns, k),
                 lambda: s.pin(ns, k, "a", 10)):
        with pytest.raises(ValueError):
            call()
    assert os.listdir(s.blocks_dir) == [] and os.listdir(s.pins_dir) == []


@pytest.mark.parametrize("owner", ["", "../x", "a/b", ".hidden", "-x", "a b", "x" * 65, None])
def test_owner_ids_are_checked(tmp_path, owner):
    with pytest.raises(ValueError):
        DiskStore.open(str(tmp_path), owner_id=owner)
    s = open_store(tmp_path)
    with pytest.raises(ValueError):
        s.pin(NS, key(1), owner, 10)


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


def test_layout_is_recorded_and_shared(tmp_path):
    s = open_store(tmp_path, fanout_levels=2)
    with open(os.path.join(s.root, "LAYOUT")) as f:
        assert f.read() == "kvkeeper-disk-layout 1 fanout_levels=2\n"
    k = key(0x1234)
    rel = os.path.relpath(s.block_path(NS, k), s.blocks_dir).split(os.sep)
    assert rel == [NS.hex()[:16], k.hex()[0:2], k.hex()[2:4], k.hex() + ".kvb"]
    s.write(NS, k, b"abc")
    other = open_store(tmp_path, owner="b")  # takes the recorded depth
    assert other.fanout_levels == 2 and other.read(NS, k) == b"abc" and len(other) == 1
    with pytest.raises(ValueError, match="fanout_levels=2"):
        open_store(tmp_path, owner="c", fanout_levels=1)
    with open(os.path.join(s.root, "LAYOUT"), "w") as f:
        f.write("something else\n")
    with pytest.raises(ValueError, match="another directory"):
        open_store(tmp_path, owner="d")


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


# ---------------------------------------------------------------- recovery

def test_recovery_of_1000_blocks(tmp_path):
    s = open_store(tmp_path)
    sizes = {}
    for i in range(1000):
        ns = NS if i % 3 else NS2
        sizes[(ns, key(i))] = n = (i * 37) % 3000
        s.write(ns, key(i), data(n, i))
    r = DiskStore.open(str(tmp_path), owner_id="a", fsync=False)
    s2, rep = r
    assert (rep.blocks, rep.quarantined, rep.tmp_removed) == (1000, 0, 0)
    assert rep.bytes == s2.used_bytes == sum(HEADER_BYTES + n for n in sizes.values())
    assert rep.seconds > 0
    assert {(ns, k): n for ns, k, n in s2.iter_index()} == sizes
    for i in range(0, 1000, 7):
        ns = NS if i % 3 else NS2
        assert s2.read(ns, key(i)) == data(sizes[(ns, key(i))], i)
    threaded, rep3 = DiskStore.open(str(tmp_path), owner_id="a", scan_threads=4)
    assert rep3.blocks == 1000 and {(a, b): c for a, b, c in threaded.iter_index()} == sizes


def test_scan_goes_parallel_when_io_bound(tmp_path, monkeypatch):
    s = open_store(tmp_path)
    for i in range(2000):
        s.write(NS, hashlib.sha256(b"%d" % i).digest(), data(10, i))  # spread over 256 dirs
    monkeypatch.setattr(recovery_mod, "_IO_BOUND_S_PER_FILE", 0.0)  # every read "waits on the device"
    switched = []
    real = recovery_mod.ThreadPoolExecutor
    monkeypatch.setattr(recovery_mod, "ThreadPoolExecutor",
                        lambda **kw: switched.append(kw) or real(**kw))
    s2, rep = DiskStore.open(str(tmp_path), owner_id="a", fsync=False)
    assert switched and rep.blocks == 2000 and rep.bytes == s.used_bytes
    assert sorted(s2.iter_index()) == sorted(s.iter_index())


def test_tmp_leftovers_at_open(tmp_path):
    s = open_store(tmp_path, owner="me")
    s.write(NS, key(1), b"kept")
    t = s.tmp_dir
    mine_old_pid = os.path.join(t, "me-1-00aa.tmp")
    theirs_fresh = os.path.join(t, "other-host-7-00bb.tmp")
    theirs_old = os.path.join(t, "other-host-7-00cc.tmp")
    unrelated = os.path.join(t, "README")
    for p in (mine_old_pid, theirs_fresh, theirs_old, unrelated):
        with open(p, "wb") as f:
            f.write(b"partial")
    os.utime(theirs_old, (time.time() - 3600, time.time() - 3600))
    s2, rep = DiskStore.open(str(tmp_path), owner_id="me", fsync=False)
    assert rep.tmp_removed == 2
    assert sorted(os.listdir(t)) == sorted(["other-host-7-00bb.tmp", "README"])
    assert rep.blocks == 1 and s2.read(NS, key(1)) == b"kept"
    # "me-x" is another owner, not "me" with a dash in the pid.
    with open(os.path.join(t, "me-x-1-00dd.tmp"), "wb"):
        pass
    _, rep = DiskStore.open(str(tmp_path), owner_id="me", fsync=False)
    assert rep.tmp_removed == 0 and "me-x-1-00dd.tmp" in os.listdir(t)


def test_crash_before_rename_is_not_a_block(tmp_path, monkeypatch):
    s = open_store(tmp_path, owner="me")

    def crash(src, dst):
        raise KeyboardInterrupt  # dies between fsync and rename

    monkeypatch.setattr(os, "replace", crash)
    with pytest.raises(KeyboardInterrupt):
        s.write(NS, key(1), b"never acknowledged")
    monkeypatch.undo()
    assert len(os.listdir(s.tmp_dir)) == 1  # the complete tmp file is left behind
    other, rep = DiskStore.open(str(tmp_path), owner_id="other", fsync=False)
    assert rep.blocks == 0 and not other.contains(NS, key(1))  # never indexed
    _, rep = DiskStore.open(str(tmp_path), owner_id="me", fsync=False)
    assert rep.tmp_removed == 1 and os.listdir(s.tmp_dir) == []


def test_truncated_block_is_quarantined_at_open(tmp_path):
    s = open_store(tmp_path)
    s.write(NS, key(1), data(5000))
    s.write(NS, key(2), data(5000))
    os.truncate(s.block_path(NS, key(1)), HEADER_BYTES + 4000)
    os.truncate(s.block_path(NS, key(2)), 50)  # not even a header
    s2, rep = DiskStore.open(str(tmp_path), owner_id="a", fsync=False)
    assert (rep.blocks, rep.quarantined) == (0, 2)
    assert len(quarantine(s2)) == 2 and s2.quarantined == 2
    assert not s2.contains(NS, key(1))
    with pytest.raises(NotStored):
        s2.read(NS, key(1))


def test_bad_headers_are_quarantined_at_open(tmp_path):
    s = open_store(tmp_path)
    for i in range(4):
        s.write(NS, key(i), data(300, i))
    p0, p1, p2 = (s.block_path(NS, key(i)) for i in range(3))
    with open(p0, "r+b") as f:   # a header byte flipped: header CRC fails
        f.seek(20)
        f.write(b"\xff")
    shutil.copy(p2, p1)          # key 2's block under key 1's name
    os.makedirs(os.path.dirname(s.block_path(NS, key(0xAB << 248))), exist_ok=True)
    with open(s.block_path(NS, key(0xAB << 248)), "wb") as f:
        f.write(os.urandom(HEADER_BYTES + 10))  # garbage under a valid name
    with open(os.path.join(os.path.dirname(p0), ".nfs000123"), "wb") as f:
        f.write(b"not ours")     # ignored, left alone
    s2, rep = DiskStore.open(str(tmp_path), owner_id="a", fsync=False)
    assert (rep.blocks, rep.quarantined) == (2, 3)
    assert sorted(k for _, k, _ in s2.iter_index()) == [key(2), key(3)]
    assert os.path.exists(os.path.join(os.path.dirname(p0), ".nfs000123"))


def test_kill_9_keeps_every_acknowledged_block(tmp_path):
    """A writer process is SIGKILLed mid-stream; every block it acknowledged
    (write returned) is served after restart, nothing else is half there."""
    root = str(tmp_path / "d")
    script = textwrap.dedent(f"""
        import sys
        from kvkeeper.server.tiers.disk import DiskStore
        s, _ = DiskStore.open({root!r}, owner_id="w", fsync=True)
        i = 0
        while True:
            s.write(bytes(16), i.to_bytes(32, "big"), bytes([i % 251]) * (1000 + i * 997 % 70000))
            print(i, flush=True)
            i += 1
    """)
    p = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    acked = []
    try:
        deadline = time.monotonic() + 30
        while len(acked) < 40 and time.monotonic() < deadline:
            line = p.stdout.readline()
            if not line:
                break
            acked.append(int(line))
    finally:
        p.send_signal(signal.SIGKILL)
        p.wait()
    assert len(acked) >= 40, "the writer did not get going"
    s, rep = DiskStore.open(root, owner_id="w")
    assert rep.quarantined == 0 and rep.blocks >= len(acked)
    for i in acked:
        assert s.read(bytes(16), key(i)) == bytes([i % 251]) * (1000 + i * 997 % 70000)
    assert os.listdir(s.tmp_dir) == []


# ---------------------------------------------------------------- corruption

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


# ---------------------------------------------------------------- full disk, I/O errors

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


# ---------------------------------------------------------------- several daemons

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


def test_pins_block_another_owners_delete(tmp_path):
    a = open_store(tmp_path, owner="host-a")
    b = open_store(tmp_path, owner="host-b")
    a.write(NS, key(1), b"leased by a")
    t0 = 1_000_000.0
    a.pin(NS, key(1), "host-a", ttl_s=30, now=t0)
    pin_files = os.listdir(os.path.join(a.pins_dir, NS.hex()[:16], key(1).hex()[:2]))
    assert pin_files == [f"{key(1).hex()}.host-a"]
    assert b.pinned_by_others(NS, key(1), "host-b", now=t0 + 1)
    assert not a.pinned_by_others(NS, key(1), "host-a", now=t0 + 1)   # own pin
    assert not b.pinned_by_others(NS, key(2), "host-b", now=t0 + 1)   # other key
    assert b.delete_if_unpinned(NS, key(1), "host-b", now=t0 + 1) is None
    assert a.read(NS, key(1)) == b"leased by a"
    a.pin(NS, key(1), "host-a", ttl_s=30, now=t0 + 20)                # refresh
    assert b.pinned_by_others(NS, key(1), "host-b", now=t0 + 45)
    assert not b.pinned_by_others(NS, key(1), "host-b", now=t0 + 51)  # expired
    a.unpin(NS, key(1), "host-a")
    a.unpin(NS, key(1), "host-a")                                     # twice is fine
    assert not b.pinned_by_others(NS, key(1), "host-b", now=t0 + 1)
    assert b.delete_if_unpinned(NS, key(1), "host-b", now=t0 + 1) == HEADER_BYTES + 11
    with pytest.raises(NotStored):
        a.read(NS, key(1))


def test_sweep_removes_only_expired_pins(tmp_path):
    a = open_store(tmp_path, owner="host-a")
    t0 = 1_000_000.0
    a.pin(NS, key(1), "host-a", ttl_s=10, now=t0)
    a.pin(NS, key(2), "host-b", ttl_s=100, now=t0)
    assert a.sweep_pins(now=t0 + 50) == 1 and a.gc_runs == 1
    assert a.pinned_by_others(NS, key(2), "host-a", now=t0 + 50)
    assert a.sweep_pins(now=t0 + 500) == 1 and a.gc_runs == 2


def test_unreadable_pin_protects(tmp_path):
    a = open_store(tmp_path, owner="host-a")
    a.pin(NS, key(1), "host-b", ttl_s=10, now=0)
    d = os.path.join(a.pins_dir, NS.hex()[:16], key(1).hex()[:2])
    with open(os.path.join(d, f"{key(1).hex()}.host-b"), "w") as f:
        f.write("garbage")
    assert a.pinned_by_others(NS, key(1), "host-a", now=1e12)


def _locks(tmp_path, n):
    s = open_store(tmp_path)
    return [GcLock(os.path.join(s.root, "gc.lock"), s.tmp_dir) for _ in range(n)]


def test_gc_lock_mutual_exclusion_and_takeover(tmp_path):
    la, lb = _locks(tmp_path, 2)
    t0 = 1_000_000.0
    assert la.try_acquire("host-a", 30, now=t0)
    assert la.holder().owner == "host-a"
    assert not lb.try_acquire("host-b", 30, now=t0 + 1)
    assert la.try_acquire("host-a", 30, now=t0 + 10)        # re-acquire = renew
    assert la.renew("host-a", 30, now=t0 + 20)              # now expires at t0 + 50
    assert not lb.try_acquire("host-b", 30, now=t0 + 49)
    assert lb.try_acquire("host-b", 30, now=t0 + 51)        # A's lease expired
    h = lb.holder()
    assert (h.owner, h.expires_at) == ("host-b", t0 + 81)
    assert not la.renew("host-a", 30, now=t0 + 52)          # A learns it lost
    assert not la.try_acquire("host-a", 30, now=t0 + 52)
    la.release("host-a")                                    # not A's: no effect
    assert lb.renew("host-b", 30, now=t0 + 60)
    lb.release("host-b")
    assert la.try_acquire("host-a", 30, now=t0 + 61)        # released: free at once


def test_gc_lock_prunes_old_generations(tmp_path):
    [la] = _locks(tmp_path, 1)
    for i in range(20):
        assert la.try_acquire(f"host-{i}", 1, now=10.0 * i)
    assert la.holder().generation == 20
    assert sorted(int(n) for n in os.listdir(la.dir)) == list(range(12, 21))


def test_gc_lock_late_renew_fails(tmp_path):
    [la] = _locks(tmp_path, 1)
    assert la.try_acquire("host-a", 30, now=100.0)
    assert not la.renew("host-a", 30, now=131.0)            # too late: must re-acquire
    assert la.try_acquire("host-a", 30, now=131.0)


def test_gc_lock_stale_view_cannot_steal(tmp_path, monkeypatch):
    la, lb, lc = _locks(tmp_path, 3)
    assert la.try_acquire("host-a", 30, now=100.0)
    stale = la.holder()                                     # generation 1, expiring at 130
    assert lb.try_acquire("host-b", 30, now=200.0)          # takes generation 2
    monkeypatch.setattr(lc, "holder", lambda: stale)        # C still sees generation 1
    assert not lc.try_acquire("host-c", 30, now=200.0)      # generation 2 exists: EEXIST
    monkeypatch.undo()
    assert lb.holder().owner == "host-b" and lb.renew("host-b", 30, now=201.0)


def test_gc_lock_very_stale_creator_loses(tmp_path, monkeypatch):
    la, lb = _locks(tmp_path, 2)
    assert la.try_acquire("host-a", 30, now=100.0)
    stale = la.holder()
    for i in range(12):                                     # many takeovers later...
        assert la.try_acquire(f"host-{i}", 30, now=200.0 + 100 * i)
    assert not os.path.exists(la._path(stale.generation + 1))  # ...generation 2 was pruned
    calls = iter([stale])
    monkeypatch.setattr(lb, "holder", lambda: next(calls, None) or la.holder())
    assert not lb.try_acquire("host-b", 30, now=5000.0)     # created gen 2, but 13 exists
    assert la.holder().owner == "host-11"


def test_gc_lock_race_has_one_winner(tmp_path):
    locks = _locks(tmp_path, 8)
    assert locks[0].try_acquire("old", 1, now=0.0)          # expired for everyone below
    barrier = threading.Barrier(8)
    wins = []

    def contend(i: int) -> None:
        barrier.wait()
        if locks[i].try_acquire(f"host-{i}", 30, now=100.0):
            wins.append(i)

    threads = [threading.Thread(target=contend, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(wins) == 1 and locks[0].holder().owner == f"host-{wins[0]}"


def test_gc_lock_half_written_file_is_held_for_a_grace(tmp_path):
    [la] = _locks(tmp_path, 1)
    with open(os.path.join(la.dir, f"{5:020d}"), "w"):
        pass                                                # creator died before writing
    now = time.time()
    assert not la.try_acquire("host-a", 30, now=now)
    assert la.try_acquire("host-a", 30, now=now + 120)
    assert la.holder().generation == 6
