"""Disk tier start-up (server/tiers/disk/recovery.py): the index rebuilt from headers,
tmp leftovers removed, bad files quarantined, nothing acknowledged lost to kill -9."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from disk_helpers import NS, NS2, data, key, open_store, quarantine
from kvkeeper.server.tiers.disk import recovery as recovery_mod
from kvkeeper.server.tiers.disk import HEADER_BYTES, DiskStore, NotStored


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
