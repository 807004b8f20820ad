"""Shared by the disk tier tests (test_disk_*.py): namespaces, keys, payloads, a store."""
from __future__ import annotations

import os

from kvkeeper.server.tiers.disk import DiskStore

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
