"""Pin files (server/tiers/disk/pins.py): another owner's unexpired pin blocks a delete."""
from __future__ import annotations

import os

import pytest

from disk_helpers import NS, key, open_store
from kvkeeper.server.tiers.disk import HEADER_BYTES, NotStored


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
