"""A directory several daemons share stays within disk_tier.shared_capacity_bytes
(server/tiers/disk/collect.py): the GC owner deletes the least recently used
block files its own book does not hold and nobody pins."""
from __future__ import annotations

import asyncio
import os
import time

from disk_helpers import NS, NS2, key, open_store
from kvkeeper.server.ledger.disk_index import DiskIndex
from kvkeeper.server.tiers.disk import HEADER_BYTES, NotStored, RecoveryReport
from kvkeeper.server.tiers.disk.collect import Victims, collect, list_blocks
from kvkeeper.server.tiers.disk_tier import DiskTier

SIZE = 1000
FILE = HEADER_BYTES + SIZE


def aged(store, ns, k, age_s: float) -> None:
    """Write block (ns, k) as if `age_s` seconds ago."""
    store.write(ns, k, bytes(SIZE))
    t = time.time() - age_s
    os.utime(store.block_path(ns, k), (t, t))


def names(store) -> set:
    return {os.path.basename(p)[:-4] for p, _ in list_blocks(store.layout)}


def victims(store, held=lambda ns, k: False) -> Victims:
    return Victims(held=held, pinned=lambda ns, k: store.pinned_by_others(ns, k, store.owner_id),
                   forget=store.forget, tmp_path=store.new_tmp_path)


def test_the_oldest_foreign_files_go_until_the_directory_fits(tmp_path) -> None:
    owner, other = open_store(tmp_path, owner="gc-owner"), open_store(tmp_path, owner="other")
    for i in range(6):                          # another daemon's files, oldest first
        aged(other, NS2 if i % 2 else NS, key(i), 600 - i * 60)
    aged(owner, NS, key(100), 1000)             # the oldest, but the owner's book holds it
    book = {(NS, key(100))}
    other.pin(NS, key(0), "other", ttl_s=300)   # the oldest foreign one, being read
    report = collect(owner.layout, 4 * FILE, victims(owner, lambda ns, k: (ns, k) in book))
    assert (report.files, report.bytes) == (7, 7 * FILE)
    assert (report.deleted, report.freed, report.kept_pinned) == (3, 3 * FILE, 1)
    # Left: the owner's own, the pinned one, and the two most recent foreign ones.
    assert names(owner) == {key(100).hex(), key(0).hex(), key(4).hex(), key(5).hex()}
    assert owner.read(NS, key(100)) == bytes(SIZE)
    try:
        other.read(NS2, key(1))
    except NotStored:
        pass                                    # a miss for the daemon that listed it
    else:
        raise AssertionError("a collected file was still read")
    # Within budget: a second pass deletes nothing.
    again = collect(owner.layout, 4 * FILE, victims(owner))
    assert again.deleted == 0 and again.files == 4


def test_a_read_makes_a_file_recent(tmp_path) -> None:
    owner, other = open_store(tmp_path, owner="gc-owner"), open_store(tmp_path, owner="other")
    for i in range(3):
        aged(other, NS, key(i), 300 - i * 60)   # key(0) the oldest
    other.touch(NS, key(0))                     # read now (DiskTier.read_into): the most recent
    collect(owner.layout, 2 * FILE, victims(owner))
    assert names(owner) == {key(0).hex(), key(2).hex()}


def test_the_gc_owner_collects_in_a_task_of_its_own_and_counts_it(tmp_path) -> None:
    other = open_store(tmp_path, owner="other")
    for i in range(5):
        aged(other, NS, key(i), 500 - i * 60)
    s = open_store(tmp_path, owner="gc-owner")    # found all five at start-up
    book = DiskIndex(1 << 30)
    book.adopt(NS, key(0), SIZE)                  # its book took the oldest only
    clock = [1000.0]
    tier = DiskTier(s, book, write_policy="write-through", admit_after_hits=0,
                    recovery=RecoveryReport(), threads=1, clock=lambda: clock[0],
                    shared_capacity_bytes=2 * FILE)

    async def upkeep() -> None:
        await tier.maintain()
        if tier._collecting is not None:
            await tier._collecting

    async def run() -> None:
        await upkeep()                            # takes the GC lease; no pass at start-up
        assert tier.gc_owner and tier.collected == 0
        clock[0] += 60
        await upkeep()
        assert tier.collected == 3
        assert names(s) == {key(0).hex(), key(4).hex()}
        aged(other, NS, key(9), 0)
        clock[0] += 10                            # not yet the next collection
        await upkeep()
        assert tier.collected == 3
        clock[0] += 60
        await upkeep()
        assert tier.collected == 4 and names(s) == {key(0).hex(), key(9).hex()}
        series = {c.name: c.value for c in tier.counters()}
        assert series["disk_collected_blocks"] == 4
        await tier.close()
        held = s.gc_lock.holder()
        assert held is None or held.expires_at < time.time(), "the lease was not handed back"
    asyncio.run(run())


def test_a_pass_stops_once_the_lease_is_lost(tmp_path) -> None:
    other = open_store(tmp_path, owner="other")
    for i in range(4):
        aged(other, NS, key(i), 500 - i * 60)
    owner = open_store(tmp_path, owner="gc-owner")
    asked = []

    def keep_going() -> bool:
        asked.append(1)
        return len(asked) <= 5                    # lost after the listing and one deletion
    report = collect(owner.layout, 0, victims(owner), keep_going)
    assert report.stopped and report.deleted == 1 and len(names(owner)) == 3


def test_off_by_default(tmp_path) -> None:
    s = open_store(tmp_path, owner="gc-owner")
    for i in range(3):
        aged(s, NS, key(i), 100)
    tier = DiskTier(s, DiskIndex(1 << 30), write_policy="write-through", admit_after_hits=0,
                    recovery=RecoveryReport(), threads=1)
    try:
        tier._gc_tick()
        assert tier.collected == 0 and len(names(s)) == 3
    finally:
        tier.pool.shutdown()


def test_a_copy_saved_after_the_listing_is_put_back(tmp_path, monkeypatch) -> None:
    """The save of a key the pass listed lands between the listing and the
    delete: the pass captures the new file, sees it is not the one listed,
    and links it back, so an acknowledged copy is never removed."""
    owner, other = open_store(tmp_path, owner="gc-owner"), open_store(tmp_path, owner="other")
    aged(other, NS, key(0), 600)
    aged(other, NS, key(1), 300)
    victim = owner.block_path(NS, key(0))
    real_rename = os.rename

    def save_first(src, dst):   # the re-save lands just before the pass captures the file
        if src == victim:
            other.write(NS, key(0), b"\x07" * SIZE)
        return real_rename(src, dst)
    monkeypatch.setattr(os, "rename", save_first)
    report = collect(owner.layout, 1 * FILE, victims(owner))
    # key(0) was put back; key(1), the next in line, went instead.
    assert report.deleted == 1 and names(owner) == {key(0).hex()}
    assert other.read(NS, key(0)) == b"\x07" * SIZE
    assert not os.listdir(owner.tmp_dir), "the captured copy was left behind"


def test_a_file_that_cannot_go_is_counted_and_the_pass_goes_on(tmp_path, monkeypatch) -> None:
    owner, other = open_store(tmp_path, owner="gc-owner"), open_store(tmp_path, owner="other")
    for i in range(3):
        aged(other, NS, key(i), 600 - i * 60)
    stuck = owner.block_path(NS, key(0))
    real_rename = os.rename

    def rename(src, dst):
        if src == stuck:
            raise PermissionError(1, "Operation not permitted", src)
        return real_rename(src, dst)
    monkeypatch.setattr(os, "rename", rename)
    report = collect(owner.layout, 1 * FILE, victims(owner))
    assert (report.deleted, report.errors) == (2, 1) and "not permitted" in report.last_error
    assert names(owner) == {key(0).hex()}


def test_a_capture_that_fails_puts_the_copy_back(tmp_path, monkeypatch) -> None:
    owner, other = open_store(tmp_path, owner="gc-owner"), open_store(tmp_path, owner="other")
    aged(other, NS, key(0), 600)
    real_stat = os.stat

    def stat(path, *a, **kw):
        if "/tmp/" in str(path) and str(path).endswith(".tmp"):
            raise OSError(5, "Input/output error", path)
        return real_stat(path, *a, **kw)
    monkeypatch.setattr(os, "stat", stat)
    report = collect(owner.layout, 0, victims(owner))
    monkeypatch.setattr(os, "stat", real_stat)
    assert (report.deleted, report.errors) == (0, 1)
    assert other.read(NS, key(0)) == bytes(SIZE) and not os.listdir(owner.tmp_dir)
