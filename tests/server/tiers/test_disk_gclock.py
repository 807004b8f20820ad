"""The GC lock (server/tiers/disk/gclock.py): one holder, takeover only of an expired
lease, one winner per generation."""
from __future__ import annotations

import os
import threading
import time

from disk_helpers import open_store
from kvkeeper.server.tiers.disk import GcLock


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
