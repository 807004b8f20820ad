"""Disk tier paths (server/tiers/disk/layout.py): only hex reaches a path, owner ids
are checked, the LAYOUT file fixes the fan-out depth for every daemon."""
from __future__ import annotations

import os

import pytest

from disk_helpers import NS, key, open_store
from kvkeeper.server.tiers.disk import DiskStore


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
