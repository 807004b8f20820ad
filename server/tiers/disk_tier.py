"""The disk tier below the host arena: its store behind the tier contract
(DiskBackend), the rules of a directory several daemons may share, and the
tier's own counters.

The tier stack (stack.py) decides what moves and keeps the ledger's books
right; this module only moves bytes across the disk's boundary, always in
its thread pool, never on the event loop. Sharing a directory: a copy being
read carries a pin file, so the garbage collector of any daemon keeps it;
only the holder of the GC lease (renewed every GC_INTERVAL_S) deletes
evicted files or sweeps expired pins, and never a file another daemon pins
(pins are taken on network mounts: a local file deleted mid-read stays readable).
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, Optional, Sequence

from ..errors import ClientError, ResourceExhausted, Unavailable
from ..ids import DISK, TierName
from ..ledger import Ledger
from ..ledger.disk_index import DiskIndex
from ..ledger.pages import Pages
from .backend import BlockStore, Checksum, Reach, copy_block, in_views, out_views
from .disk import (DiskFull, DiskIOError, DiskStore, RecoveryReport, TierError, VerifyReport,
                   check_ns_key)
from .disk.collect import CollectReport, Victims, collect
from .stack import TierCounter

log = logging.getLogger("kvkeeper.disk")

PIN_TTL_S = 120.0
GC_LEASE_S = 30.0
GC_INTERVAL_S = 10.0
# Start-up sizing when disk_tier.capacity_bytes is 0: leave the filesystem some room.
AUTO_CAPACITY_SHARE = 0.9
# What the tier exports beside its book, in the order counters() reads the values.
SERIES: tuple[tuple[str, str, str], ...] = (
    ("disk_read_bytes", "counter", "Bytes read from the disk tier's files."),
    ("disk_written_bytes", "counter", "Bytes written to the disk tier's files."),
    ("disk_io_errors", "counter", "Failed disk tier file operations."),
    ("disk_checksum_failures", "counter", "Disk blocks that failed their checksum (never served)."),
    ("disk_quarantined_blocks", "counter", "Disk block files moved to quarantine."),
    ("disk_gc_runs", "counter", "Garbage-collection runs of the disk tier."),
    ("disk_flush_failures", "counter", "Blocks that could not be written to the disk tier."),
    ("disk_recovery_seconds", "gauge", "Time the disk tier took to rebuild its index at start-up."),
    ("disk_recovered_blocks", "gauge", "Blocks found on disk at start-up."),
    ("disk_collected_blocks", "counter", "Block files the GC owner deleted to keep a shared "
     "directory within disk_tier.shared_capacity_bytes."),
)
# How often the GC owner lists a shared directory (disk_tier.shared_capacity_bytes).
COLLECT_INTERVAL_S = 60.0


def default_owner() -> str:
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())[:64]
    return f"{host or 'host'}-{os.getpid()}"


class DiskLoc(NamedTuple):
    ns: bytes
    key: bytes
    nbytes: int


class DiskBackend:
    """The disk store behind the tier contract: one file per block, found by
    (namespace, key)."""

    name = "disk"
    persistent = True
    tracks_presence = True
    reach = Reach.FILES

    def __init__(self, store: DiskStore, capacity_bytes: int = 0) -> None:
        """`capacity_bytes`: what the tier may use; 0 means what the filesystem
        gives now (free space plus the blocks already stored)."""
        self.store = store
        self.capacity_bytes = capacity_bytes or store.fs_free_bytes() + store.used_bytes

    def used_bytes(self) -> int:
        return self.store.used_bytes

    def locate(self, ns: bytes, key: bytes, nbytes: int, pages: Pages | None = None) -> DiskLoc:
        ns, key = check_ns_key(ns, key)
        if pages is not None:
            raise ValueError("disk locations take no pages")
        if nbytes <= 0:
            raise ValueError(f"a block has at least one byte, got nbytes={nbytes}")
        return DiskLoc(ns, key, nbytes)

    def write(self, loc: DiskLoc, data: Any, checksum: Optional[Checksum] = None) -> int:
        return self.store.write(loc.ns, loc.key, in_views(data, loc.nbytes), checksum)

    def read_into(self, loc: DiskLoc, out: Any) -> Optional[Checksum]:
        return self.store.read_into(loc.ns, loc.key, out_views(out, loc.nbytes))

    def discard(self, loc: DiskLoc) -> int:
        return self.store.delete(loc.ns, loc.key)

    def contains(self, loc: DiskLoc) -> Optional[bool]:
        return self.store.contains(loc.ns, loc.key)

    def view(self, loc: DiskLoc) -> Optional[memoryview]:
        return None  # a file: bytes are copied in and out

    def views(self, loc: DiskLoc) -> Optional[list[memoryview]]:
        return None


class DiskTier:
    """One lower tier of the stack (see stack.LowerTier)."""

    name: TierName = DISK
    keeps_book = True   # the book is the directory's index (rebuilt at start-up)

    def __init__(self, store: DiskStore, book: DiskIndex, *, write_policy: str,
                 admit_after_hits: int, recovery: RecoveryReport,
                 clock: Callable[[], float] = time.monotonic, threads: int = 4,
                 shared_capacity_bytes: int = 0) -> None:
        self.store = store
        # 0: no collection across daemons; else the directory's budget (collect.py).
        self.shared_capacity_bytes = shared_capacity_bytes
        self._last_collect = clock()   # the first pass a while after start-up, not in it
        self._collecting: Optional[asyncio.Task[None]] = None
        self._closing = False
        self._renewed = 0.0
        self._over_budget = False     # for logging: warn once while a pass cannot get under
        self.backend = DiskBackend(store, book.capacity_bytes)
        # The ledger keeps this book; the tier reads it only for its tests and tools,
        # and for what a shared collection must leave to it (collect_shared).
        self.index = book
        self.write_back = write_policy == "write-back"
        self.admit_after_hits = admit_after_hits
        self.recovery = recovery
        self.clock = clock
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvkeeper-disk")
        self.flush_failures = 0
        self.collected = 0        # files a shared collection deleted (collect_shared)
        self.gc_owner = False
        self._last_gc = -1e9

    @classmethod
    def open(cls, ledger: Ledger, *, path: str, capacity_bytes: int, write_policy: str,
             admit_after_hits: int, owner_id: str = "",
             shared_capacity_bytes: int = 0) -> "DiskTier":
        """Open the directory and give the ledger the tier's book, rebuilt from
        the files (blocking: start-up only)."""
        store, report = DiskStore.open(path, owner_id=owner_id or default_owner())
        if capacity_bytes <= 0:
            capacity_bytes = max(1, int((store.fs_free_bytes() + store.used_bytes)
                                        * AUTO_CAPACITY_SHARE))
        book = ledger.add_book(cls.name, capacity_bytes)
        skipped = 0
        for ns, key, nbytes in store.iter_index():
            if book.adopt(ns, key, nbytes) is None:
                skipped += 1
        if skipped:
            log.warning("disk tier: %d blocks on disk exceed the configured capacity and are "
                        "not served", skipped)
        log.info("disk tier %s: recovered %d blocks (%d B) in %.2fs, %d tmp files removed, "
                 "%d quarantined", path, report.blocks, report.bytes, report.seconds,
                 report.tmp_removed, report.quarantined)
        tier = cls(store, book, write_policy=write_policy, admit_after_hits=admit_after_hits,
                   recovery=report, shared_capacity_bytes=shared_capacity_bytes)
        tier._gc_tick()
        return tier

    async def io(self, fn: Callable[..., Any], *args: Any) -> Any:
        """Run blocking file work in the tier's threads."""
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ------------------------------------------------------------ moving bytes
    def loc(self, ns: bytes, key: bytes, nbytes: int) -> DiskLoc:
        return self.backend.locate(ns, key, nbytes)

    async def probe(self, ns: bytes, key: bytes) -> Optional[int]:
        """The payload size of a copy the directory holds though the book does
        not (another daemon wrote it), or None."""
        try:
            found = await self.io(self.store.contains, ns, key)
        except DiskIOError as e:
            log.warning("disk tier lookup failed: %s", e)
            return None
        return self.store.indexed_bytes(ns, key) if found else None

    async def probe_run(self, ns: bytes, keys: Sequence[bytes]) -> list[Optional[int]]:
        """The first key's probe (one file lookup per call: the stack asks again
        for the next key no book holds)."""
        return [await self.probe(ns, keys[0])] if keys else []

    async def read_block(self, loc: DiskLoc, dst: BlockStore[Any], dst_loc: Any) -> Optional[Checksum]:
        return await self.io(self.read_into, loc, dst, dst_loc)

    async def write_block(self, src: BlockStore[Any], src_loc: Any, loc: DiskLoc,
                          checksum: Optional[Checksum] = None) -> None:
        await self.io(self.write_from, src, src_loc, loc, checksum)

    def read_into(self, loc: DiskLoc, dst: BlockStore[Any], dst_loc: Any) -> Optional[Checksum]:
        """Copy a stored block into another tier (blocking); returns the checksum
        its writer committed, which the file keeps. TierError when the copy is
        unreadable: NotStored (gone), CorruptBlock, DiskIOError."""
        if self.shared_capacity_bytes:   # its mtime is its last use (collect.py)
            self.store.touch(loc.ns, loc.key)
        if not self.store.remote:
            # On a local filesystem a file deleted mid-read stays readable
            # through its open descriptor: no pin needed (one saved a tmp file,
            # a write, a rename and an unlink per load).
            return copy_block(self.backend, loc, dst, dst_loc, loc.nbytes)
        # On a network mount another host's GC deleting the file would fail
        # the read: the pin file tells the GC owner not to delete it meanwhile.
        owner = self.store.owner_id
        self.store.pin(loc.ns, loc.key, owner, PIN_TTL_S)
        try:
            return copy_block(self.backend, loc, dst, dst_loc, loc.nbytes)
        finally:
            self.store.unpin(loc.ns, loc.key, owner)

    def write_from(self, src: BlockStore[Any], src_loc: Any, loc: DiskLoc,
                   checksum: Optional[Checksum] = None) -> None:
        """Store a block copied from another tier with its writer's checksum
        (blocking); DiskIOError on failure."""
        copy_block(src, src_loc, self.backend, loc, loc.nbytes, checksum)

    @staticmethod
    def refusal(e: TierError) -> ClientError:
        """What a write-through save answers when its block could not be stored."""
        return ResourceExhausted(str(e)) if isinstance(e, DiskFull) else Unavailable(str(e))

    async def forget(self, where: tuple[bytes, bytes]) -> None:
        """Delete an evicted block's file: only the GC owner deletes, and never a
        file another daemon has pinned. Other daemons just forget the entry."""
        if not self.gc_owner:
            return
        owner = self.store.owner_id
        try:
            freed = await self.io(self.store.delete_if_unpinned, where[0], where[1], owner)
        except DiskIOError as e:
            log.warning("disk tier eviction could not delete a file: %s", e)
            return
        if freed is None:
            log.info("disk tier: evicted block pinned by another daemon; file kept")

    # ------------------------------------------------------------ upkeep
    async def maintain(self) -> None:
        """Periodic: renew (or try to take) the GC lease; the owner sweeps expired pins,
        and starts a shared collection when one is due (a task of its own: a long
        pass must not hold up the daemon's upkeep)."""
        if self.clock() - self._last_gc >= GC_INTERVAL_S:
            await self.io(self._gc_tick)
        if (self.gc_owner and self.shared_capacity_bytes and self._collecting is None
                and not self._closing and self.clock() - self._last_collect >= COLLECT_INTERVAL_S):
            self._last_collect = self.clock()
            self._collecting = asyncio.get_running_loop().create_task(self._collect())

    async def _collect(self) -> None:
        try:
            await self.io(self.collect_shared)
        finally:
            self._collecting = None

    def _gc_tick(self) -> None:
        self._last_gc = self.clock()
        try:
            owner = self.store.gc_lock.try_acquire(self.store.owner_id, GC_LEASE_S)
            if owner and not self.gc_owner:
                log.info("disk tier: this daemon (%s) now garbage-collects %s",
                         self.store.owner_id, self.store.root)
            self.gc_owner = owner
            if owner:
                self.store.sweep_pins()
        except DiskIOError as e:
            self.gc_owner = False
            log.warning("disk tier GC lease: %s", e)

    def collect_shared(self) -> CollectReport:
        """Delete least recently used files of a shared directory beyond its budget
        (blocking; the GC owner's, see collect.py). Never raises: a file that
        cannot go is counted and the pass goes on."""
        st = self.store
        # The book's dict is the event loop's: a membership test from this
        # thread is safe, and a stale answer costs one miss or one pass's delay.
        book = self.index.entries
        owner = st.owner_id
        victims = Victims(held=lambda ns, key: (ns, key) in book,
                          pinned=lambda ns, key: st.pinned_by_others(ns, key, owner),
                          forget=st.forget, tmp_path=st.new_tmp_path)
        self._renewed = self.clock()
        try:
            report = collect(st.layout, self.shared_capacity_bytes, victims, self._still_owner)
        except (OSError, TierError) as e:
            log.warning("disk tier: collecting the shared directory failed: %s", e)
            return CollectReport()
        self.collected += report.deleted
        if report.deleted:
            log.info("disk tier: shared directory %s held %d B in %d files (budget %d B); "
                     "deleted %d least recently used (%d B) in %.2fs",
                     st.root, report.bytes, report.files, self.shared_capacity_bytes,
                     report.deleted, report.freed, report.seconds)
        over = report.bytes - report.freed - report.gone > self.shared_capacity_bytes
        if over and not report.stopped and not self._over_budget:
            log.warning("disk tier: shared directory %s stays over its budget (%d B): what is "
                        "left is held by this daemon's book (%d B; capacity_bytes), pinned "
                        "(%d) or could not be deleted (%d: %s)", st.root,
                        self.shared_capacity_bytes, self.index.used_bytes, report.kept_pinned,
                        report.errors, report.last_error or "-")
        self._over_budget = over
        return report

    def _still_owner(self) -> bool:
        """Asked before each file of a pass: it renews the GC lease every
        GC_INTERVAL_S, and ends the pass once the lease is lost or the tier closes."""
        if self._closing or not self.gc_owner:
            return False
        if self.clock() - self._renewed >= GC_INTERVAL_S:
            self._renewed = self.clock()
            try:
                self.gc_owner = self.store.gc_lock.renew(self.store.owner_id, GC_LEASE_S)
            except DiskIOError:
                self.gc_owner = False
        return self.gc_owner

    def verify_all(self, progress: Callable[[int, int], None]) -> VerifyReport:
        """Re-check every stored block (blocking; admin's Verify)."""
        return self.store.verify_all(progress)

    @property
    def quarantined(self) -> int:
        return self.store.quarantined

    async def close(self) -> None:
        """Hand the GC lease back and stop the threads (flushes are drained first)."""
        self._closing = True               # a running collection stops at its next file
        if self._collecting is not None:
            await asyncio.gather(self._collecting, return_exceptions=True)
        if self.gc_owner:
            await self.io(self.store.gc_lock.release, self.store.owner_id)
        self.pool.shutdown(wait=True)

    # ------------------------------------------------------------ counters
    def counters(self) -> list[TierCounter]:
        """The tier's own series, read at scrape time (scalars only: another thread)."""
        st = self.store
        values = (st.bytes_read, st.bytes_written, st.io_errors, st.checksum_failures,
                  st.quarantined, st.gc_runs, self.flush_failures, self.recovery.seconds,
                  self.recovery.blocks, self.collected)
        return [TierCounter(name, kind, text, v) for (name, kind, text), v in zip(SERIES, values)]

    def errors(self) -> dict[str, int]:
        """Error counters an operator is told about when they grow (watch.py)."""
        st = self.store
        return {"io_errors": st.io_errors, "checksum_failures": st.checksum_failures,
                "flush_failures": self.flush_failures}
