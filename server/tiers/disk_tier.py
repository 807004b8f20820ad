"""The disk tier in motion: flushes arena blocks to the DiskStore and promotes
disk hits back into the arena. The asyncio adapter between the sans-I/O ledger
and DiskIndex on one side and the blocking DiskStore on the other; every file
operation runs in a thread pool, never on the event loop.

Why blocks cannot be lost between tiers: a block is flushed while an internal
lease pins it in the arena, so its pages cannot be evicted or reused mid-write;
with write-back, every committed block is pinned from commit until its flush
ends, so the arena only ever evicts blocks that are already on disk (or that
admission chose not to keep). A disk hit is copied into freshly reserved
arena pages (an internal save) before the caller's lease is taken, so Load
and LoadStream only ever read the arena.
"""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, Optional, Sequence

from ..errors import ResourceExhausted, Unavailable
from ..ids import DISK, INTERNAL, LOCAL, Identity, SessionId, TierName
from ..ledger import Block, BlockState, Ledger, MatchResult, Namespace
from ..ledger.disk_index import DiskEntry, DiskIndex
from .disk import CorruptBlock, DiskFull, DiskIOError, DiskStore, NotStored, RecoveryReport

log = logging.getLogger("kvkeeper.disk")

INTERNAL_INSTANCE = "kvkeeper-internal"
PIN_TTL_S = 120.0
GC_LEASE_S = 30.0
GC_INTERVAL_S = 10.0


def default_owner() -> str:
    host = "".join(c if c.isalnum() or c in "._-" else "-" for c in socket.gethostname())[:64]
    return f"{host or 'host'}-{os.getpid()}"


class DiskTier:
    def __init__(self, ledger: Ledger, arena: Any, store: DiskStore, index: DiskIndex, *,
                 write_policy: str, admit_after_hits: int, recovery: RecoveryReport,
                 clock: Callable[[], float] = time.monotonic, threads: int = 4) -> None:
        self.ledger = ledger
        self.arena = arena
        self.store = store
        self.index = index
        self.write_back = write_policy == "write-back"
        self.admit_after_hits = admit_after_hits
        self.recovery = recovery
        self.clock = clock
        self.pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="kvkeeper-disk")
        self._internal: dict[bytes, SessionId] = {}
        self._flushes: set[asyncio.Task[Any]] = set()
        self._promotions: dict[tuple[bytes, bytes], asyncio.Future[bool]] = {}
        self.flush_failures = 0
        self.draining = False
        self.gc_owner = False
        self._last_gc = -1e9

    @classmethod
    def open(cls, ledger: Ledger, arena: Any, *, path: str, capacity_bytes: int,
             write_policy: str, admit_after_hits: int, owner_id: str = "") -> "DiskTier":
        """Open the directory, rebuild the index from it (blocking: start-up only)."""
        store, report = DiskStore.open(path, owner_id=owner_id or default_owner())
        if capacity_bytes <= 0:
            capacity_bytes = max(1, int((store.fs_free_bytes() + store.used_bytes) * 0.9))
        index = DiskIndex(capacity_bytes)
        skipped = 0
        for ns, key, nbytes in store.iter_index():
            if index.adopt(ns, key, nbytes) is None:
                skipped += 1
        if skipped:
            log.warning("disk tier: %d blocks on disk exceed the configured capacity and are "
                        "not served", skipped)
        log.info("disk tier %s: recovered %d blocks (%d B) in %.2fs, %d tmp files removed, "
                 "%d quarantined", path, report.blocks, report.bytes, report.seconds,
                 report.tmp_removed, report.quarantined)
        tier = cls(ledger, arena, store, index, write_policy=write_policy,
                   admit_after_hits=admit_after_hits, recovery=report)
        tier._gc_tick()
        return tier

    async def _io(self, fn: Callable[..., Any], *args: Any) -> Any:
        return await asyncio.get_running_loop().run_in_executor(self.pool, fn, *args)

    # ------------------------------------------------------------ internal sessions
    def _session(self, ns: Namespace) -> SessionId:
        """The daemon's own session in `ns`, for internal leases and promotions."""
        sid = self._internal.get(ns.id)
        if sid is None or sid not in self.ledger.sessions:
            sid = self.ledger.register_session(INTERNAL_INSTANCE, ns.descriptor, self.clock(),
                                               owner=INTERNAL).id
            self._internal[ns.id] = sid
        return sid

    def keep_alive(self) -> None:
        """Called before each expiry sweep: internal sessions never expire."""
        now = self.clock()
        for sid in list(self._internal.values()):
            if sid in self.ledger.sessions:
                self.ledger.heartbeat(sid, now, INTERNAL)

    async def maintain(self) -> None:
        """Periodic: renew (or try to take) the GC lease; the owner sweeps expired pins."""
        if self.clock() - self._last_gc >= GC_INTERVAL_S:
            await self._io(self._gc_tick)

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

    def is_internal(self, sid: str) -> bool:
        return sid in self._internal.values()

    # ------------------------------------------------------------ match with promotion
    async def match(self, sid: SessionId, keys: Sequence[bytes], *, lease: bool,
                    report_use: bool = False, owner: Identity = LOCAL) -> MatchResult:
        session = self.ledger.session(sid, self.clock(), owner)
        keys = self.ledger._check_keys(keys, unique=False)
        ns = session.ns
        on_disk: list[int] = []
        n = 0
        for i, k in enumerate(keys):
            b = ns.blocks.get(k)  # type: ignore[call-overload]
            if b is not None:
                if b.state is not BlockState.COMMITTED:
                    break
                n = i + 1
                continue
            if self.index.get(ns.id, k) is None and not await self._probe(ns, k):
                break
            on_disk.append(i)
            n = i + 1
        if on_disk and lease:
            promoted = await self._promote(ns, [keys[i] for i in on_disk])
            # The chain ends at the first block that could not be brought up.
            for i, ok in zip(on_disk, promoted):
                if not ok:
                    n = i
                    break
            on_disk = [i for i in on_disk if i < n]
        elif on_disk:
            for i in on_disk:
                e = self.index.get(ns.id, keys[i])
                if e is not None:
                    self.index.touch(e)
        lower = set(on_disk)
        if not lease:
            host_keys = [k for i, k in enumerate(keys[:n]) if i not in lower]
            self.ledger.match(sid, host_keys, lease=False, now=self.clock(), report_use=report_use,
                              owner=owner)
            # The request looked up every key, not only those the arena holds.
            self._asked_beyond(ns, len(keys) - len(host_keys), report_use)
            top = self.ledger.top.name
            return MatchResult(n, [DISK if i in lower else top for i in range(n)], None)
        r = self.ledger.match(sid, keys[:n], lease=True, now=self.clock(), counted_elsewhere=lower,
                              report_use=report_use, owner=owner)
        self._asked_beyond(ns, len(keys) - n, report_use)
        tiers: list[TierName] = [DISK if i in lower else t for i, t in enumerate(r.tiers)]
        self._admit(ns, keys[:r.matched])
        return MatchResult(r.matched, tiers, r.lease_id)

    def _asked_beyond(self, ns: Namespace, keys: int, report_use: bool) -> None:
        """Count the keys of a Match that the ledger's own match() was not given."""
        self.ledger.lookup_keys += keys
        if not report_use:
            self.ledger.usage.asked(ns, keys)

    async def _probe(self, ns: Namespace, key: bytes) -> bool:
        """An index miss falls back to the file: another daemon may have written it."""
        try:
            found = await self._io(self.store.contains, ns.id, key)
        except DiskIOError as e:
            log.warning("disk tier lookup failed: %s", e)
            return False
        if not found:
            return False
        nbytes = self.store.indexed_bytes(ns.id, key)
        if nbytes != ns.block_bytes:
            return False
        return self.index.adopt(ns.id, key, nbytes) is not None

    async def _promote(self, ns: Namespace, keys: list[bytes]) -> list[bool]:
        """Copy disk hits into the arena; True for each block now committed there."""
        return list(await asyncio.gather(*(self._promote_one(ns, k) for k in keys)))

    async def _promote_one(self, ns: Namespace, key: bytes) -> bool:
        where = (ns.id, key)
        pending = self._promotions.get(where)
        if pending is not None:
            return await asyncio.shield(pending)
        fut: asyncio.Future[bool] = asyncio.get_running_loop().create_future()
        self._promotions[where] = fut
        try:
            ok = await self._do_promote(ns, key)
        except Exception:  # noqa: BLE001 - a failed promotion is a miss, never an error
            log.exception("promotion of a disk block failed")
            ok = False
        finally:
            del self._promotions[where]
        fut.set_result(ok)
        return ok

    async def _do_promote(self, ns: Namespace, key: bytes) -> bool:
        entry = self.index.get(ns.id, key)
        if entry is None:
            return False
        sid = self._session(ns)
        try:
            r = self.ledger.reserve(sid, [key], self.clock(), owner=INTERNAL)
        except ResourceExhausted:
            return False  # the arena is pinned full: serve what the host has
        b = r.blocks[0]
        if b is None:  # it reached the arena meanwhile
            return ns.blocks.get(key) is not None and ns.blocks[key].state is BlockState.COMMITTED
        self.index.pin(entry)
        try:
            algo, digest = await self._io(self._read_into_pages, ns, key, b)
        except (CorruptBlock, NotStored, DiskIOError) as e:
            log.warning("disk block unreadable, treated as a miss: %s", e)
            self.index.unpin(entry)
            self.index.drop(entry, "corrupt" if isinstance(e, CorruptBlock) else "lost")
            self.ledger.abort(sid, r.reservation_id, self.clock(), INTERNAL)
            return False
        self.index.unpin(entry)
        self.index.touch(entry)
        # The file's checksum is its writer's (DiskStore.write): readers check it again.
        self.ledger.commit(sid, r.reservation_id, self.clock(), owner=INTERNAL,
                           checksum_algo=algo, checksums=[digest])
        return True

    def _read_into_pages(self, ns: Namespace, key: bytes, b: Block) -> tuple[int, int]:
        # The pin file tells the GC owner (maybe another daemon) not to delete
        # the file while it is being read.
        owner = self.store.owner_id
        self.store.pin(ns.id, key, owner, PIN_TTL_S)
        try:
            extents = self.arena.extents(b.pages, ns.pages_per_block, ns.block_bytes)
            if len(extents) == 1:
                return self.store.read_into(ns.id, key, self.arena.view(*extents[0]))
            buf = bytearray(ns.block_bytes)
            checksum = self.store.read_into(ns.id, key, buf)
            self.arena.write(extents, buf)
            return checksum
        finally:
            self.store.unpin(ns.id, key, owner)

    # ------------------------------------------------------------ flushing
    def _admit(self, ns: Namespace, keys: Sequence[bytes]) -> None:
        """Admission: a block reaching admit_after_hits hits is flushed now."""
        if not self.admit_after_hits:
            return
        due = [k for k in keys if ns.blocks[k].hits >= self.admit_after_hits
               and (ns.id, k) not in self.index.entries]
        if due:
            self._spawn_flush(ns, due)

    async def committed(self, ns: Namespace, keys: Sequence[bytes]) -> None:
        """Called after a client's commit. Write-through: returns once on disk."""
        if self.admit_after_hits or not keys:
            return
        if self.write_back:
            self._spawn_flush(ns, keys)
            return
        await self.flush(ns, keys, strict=True)

    def _spawn_flush(self, ns: Namespace, keys: Sequence[bytes]) -> None:
        # Pin now, synchronously, so eviction cannot take the blocks before the task runs.
        sid = self._session(ns)
        r = self.ledger.match(sid, keys, lease=True, now=self.clock(), internal=True,
                              owner=INTERNAL)
        if not r.lease_id:
            return
        task = asyncio.get_running_loop().create_task(
            self._flush_leased(ns, sid, r.lease_id, strict=False))
        self._flushes.add(task)
        task.add_done_callback(self._flushes.discard)

    async def flush(self, ns: Namespace, keys: Sequence[bytes], *, strict: bool) -> None:
        sid = self._session(ns)
        r = self.ledger.match(sid, keys, lease=True, now=self.clock(), internal=True,
                              owner=INTERNAL)
        if r.lease_id:
            await self._flush_leased(ns, sid, r.lease_id, strict=strict)

    async def _flush_leased(self, ns: Namespace, sid: SessionId, lease_id: int, *,
                            strict: bool) -> None:
        """Write the leased blocks to disk, then drop the internal lease.
        strict: raise on the first failure (write-through acknowledges durability)."""
        try:
            lease = self.ledger.lease(sid, lease_id, self.clock(), INTERNAL)
            for b in list(lease.blocks):
                await self._flush_block(ns, b, strict)
        finally:
            if self.ledger.leases.get(lease_id) is not None:
                self.ledger.release(sid, lease_id, self.clock(), owner=INTERNAL)

    async def _flush_block(self, ns: Namespace, b: Block, strict: bool) -> None:
        try:
            res = self.index.reserve(ns.id, b.key, ns.block_bytes)
        except ResourceExhausted:
            self.flush_failures += 1
            if strict:
                raise
            log.warning("disk tier full: block not persisted (write-back)")
            return
        if res is None:
            return  # already on disk, or being written
        for where in res.evicted:
            await self._delete(where)
        try:
            await self._io(self._write_from_pages, ns, b)
        except DiskIOError as e:
            self.index.failed(res.entry)
            self.flush_failures += 1
            if strict:
                if isinstance(e, DiskFull):
                    raise ResourceExhausted(str(e)) from e
                raise Unavailable(str(e)) from e
            log.warning("write-back flush failed: %s", e)
            return
        self.index.written(res.entry)

    def _write_from_pages(self, ns: Namespace, b: Block) -> None:
        extents = self.arena.extents(b.pages, ns.pages_per_block, ns.block_bytes)
        data = self.arena.view(*extents[0]) if len(extents) == 1 else self.arena.read(extents)
        self.store.write(ns.id, b.key, data, b.checksum)

    async def _delete(self, where: tuple[bytes, bytes]) -> None:
        """Delete an evicted block's file: only the GC owner deletes, and never a
        file another daemon has pinned. Other daemons just forget the entry."""
        if not self.gc_owner:
            return
        owner = self.store.owner_id
        try:
            freed = await self._io(self.store.delete_if_unpinned, where[0], where[1], owner)
        except DiskIOError as e:
            log.warning("disk tier eviction could not delete a file: %s", e)
            return
        if freed is None:
            log.info("disk tier: evicted block pinned by another daemon; file kept")

    async def drain(self) -> None:
        """Finish every write-back flush (graceful shutdown)."""
        self.draining = True
        while self._flushes:
            await asyncio.gather(*list(self._flushes), return_exceptions=True)

    async def close(self) -> None:
        await self.drain()
        if self.gc_owner:
            await self._io(self.store.gc_lock.release, self.store.owner_id)
        self.pool.shutdown(wait=True)

    def stats_entries(self) -> list[DiskEntry]:
        return list(self.index)
