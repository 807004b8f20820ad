"""DiskStore: blocks in files under one directory that several daemons may share.

The directory is a local disk or a shared mount (NFS, CephFS, 3FS-style). The
store is pure synchronous I/O: the daemon calls it from a thread pool, off the
event loop. Calls on different keys may run concurrently from many threads.
Where the files go is `layout`, their header `header`, how a write becomes
durable `durability`, the start-up scan `recovery`, pins `pins` and the GC
lease `gclock`.

Integrity. Every read checks the header against the requested namespace/key/
length and the payload against its checksum (XXH3-64; CRC32 in files written
by earlier daemons, see header.py); a failure raises CorruptBlock and
moves the file to quarantine/ (a rename, so the evidence is kept), so a
corrupt block is a miss, never data. A bad header found at open is
quarantined the same way.

Several daemons, one directory. Each keeps its own in-memory index; a miss
falls back to the file, so a block written by daemon A is found by daemon B.
An index hit may be stale (another daemon deleted the file): the read then
raises NotStored and the entry is dropped.
"""
from __future__ import annotations

import errno
import os
import threading
import time
from collections.abc import Callable, Iterator
from contextlib import suppress
from typing import Any, NoReturn

from kvkeeper.client.arena_format import byte_view
from kvkeeper.client.checksum import checksum_parts

from .durability import (FSYNC_AFTER_RENAME, NO_SYNC, DurableDirs, durability_for,
                         is_remote, mount_fstype, publish)
from .errors import CorruptBlock, DiskIOError, NotStored, disk_io_error
from .fileio import RDONLY, Buffers, read_block
from .gclock import GcLock
from .header import (HEADER_BYTES, HEADER_FIELDS_BYTES, PAYLOAD_ALGOS, WRITE_ALGO, Header,
                     check_ns_key, pack_header, parse_header)
from .layout import Layout, check_owner, make_dirs, recorded_fanout_levels, tmp_path
from .pins import Pins
from .recovery import SCAN_THREADS, RecoveryReport, clean_tmp, scan
from .verify import VerifyReport, verify_blocks


class DiskStore:
    """Blocks in files under one directory. Create with `DiskStore.open`."""

    def __init__(self, root: str, owner_id: str, min_free_bytes: int, fanout_levels: int,
                 durability: str, syncfs: Callable[[str], None] | None, remote: bool) -> None:
        self.root = root
        self.owner_id = owner_id
        self.fanout_levels = fanout_levels
        self.fsync = durability != NO_SYNC
        self.durability = durability   # how a write becomes durable here (durability.py)
        self.remote = remote           # a network or FUSE mount
        self.syncfs = syncfs
        self.min_free_bytes = min_free_bytes
        self.layout = Layout(root, fanout_levels)
        self.blocks_dir = self.layout.blocks_dir
        self.tmp_dir = self.layout.tmp_dir
        self.quarantine_dir = self.layout.quarantine_dir
        self.pins_dir = self.layout.pins_dir
        self.gc_lock = GcLock(self.layout.gc_dir, self.tmp_dir)
        self._lock = threading.Lock()
        self._index: dict[tuple[bytes, bytes], int] = {}   # (ns, key) -> payload bytes
        self._used = 0                                      # file bytes of indexed blocks
        self._forgets = 0   # forget() calls: a lookup's stat from before one is taken again
        # The block's own fsync covers its new directories (DurableDirs).
        self._dirs = DurableDirs(durability not in (NO_SYNC, FSYNC_AFTER_RENAME))
        self._pid = os.getpid()
        self._pins = Pins(self.layout, self._dirs, self.new_tmp_path)
        # Counters (monotonic), read by the metrics collector.
        self.bytes_read = 0
        self.bytes_written = 0
        self.io_errors = 0
        self.checksum_failures = 0
        self.quarantined = 0
        self.gc_runs = 0

    # ------------------------------------------------------------ open / recovery

    @classmethod
    def open(cls, root: str, *, owner_id: str, fsync: bool = True, min_free_bytes: int = 0,
             fanout_levels: int | None = None, tmp_max_age_s: float = 600.0,
             scan_threads: int | None = None) -> tuple[DiskStore, RecoveryReport]:
        """Open (creating if needed) the store at `root` and rebuild the index.

        `owner_id` names this daemon among those sharing `root`: stable across
        restarts, unique among live daemons. `min_free_bytes` > 0 makes a write
        fail with DiskFull before it would leave less than that free.
        `fanout_levels` (1 or 2) is fixed when the directory is created and
        recorded in root/LAYOUT; None takes the recorded one (default 1).
        `scan_threads` None (auto): threads on a network or FUSE mount (each open
        a round trip); on a local filesystem serial while headers come from the
        page cache (after kill -9: threads only fight over the GIL), threads
        once reads wait on the device (cold cache).
        """
        check_owner(owner_id)
        if min_free_bytes < 0:
            raise ValueError(f"min_free_bytes must be >= 0, got {min_free_bytes}")
        if fanout_levels not in (None, 1, 2):
            raise ValueError(f"fanout_levels must be 1 or 2, got {fanout_levels!r}")
        t0 = time.perf_counter()
        root = os.path.abspath(root)
        make_dirs(root)
        levels = recorded_fanout_levels(root, fanout_levels)
        fstype = mount_fstype(root)
        store = cls(root, owner_id, min_free_bytes, levels, *durability_for(fstype, fsync),
                    remote=is_remote(fstype))
        report = RecoveryReport()
        report.tmp_removed = clean_tmp(store.tmp_dir, owner_id, tmp_max_age_s)
        if scan_threads is None and store.remote:
            scan_threads = SCAN_THREADS
        for found, bad in scan(store.layout, scan_threads):
            for ns, key, plen in found:
                store._record(ns, key, plen)
            for path in bad:
                if store._quarantine(path):
                    report.quarantined += 1
        report.blocks, report.bytes = len(store._index), store._used
        report.seconds = time.perf_counter() - t0
        return store, report

    def block_path(self, ns: bytes, key: bytes) -> str:
        return self.layout.block_path(ns, key)

    def new_tmp_path(self) -> str:
        """A fresh private file name under tmp/ (same filesystem as the blocks)."""
        return tmp_path(self.tmp_dir, self.owner_id, self._pid)

    # ------------------------------------------------------------ write

    def write(self, ns: bytes, key: bytes, data: Any,
              checksum: tuple[int, int] | None = None) -> int:
        """Store `data` as the block (ns, key), durably; returns bytes on disk.
        `data` is a buffer, or a list of them: the payload's pieces in order
        (a gathered write, as from an arena block's extents). Writing an
        existing key replaces it (the last rename wins).

        checksum: the block's (algorithm, value) as its writer committed it;
        where it is one a header may name (XXH3-64, CRC32) the file keeps it
        as its payload checksum instead of hashing the payload again, so a
        block read back carries the writer's own checksum to its readers (a
        wrong one only makes the file fail its read: a miss). Else the payload
        is hashed with XXH3-64."""
        ns, key = check_ns_key(ns, key)
        parts = [byte_view(d) for d in data] if isinstance(data, list) else [byte_view(data)]
        n = sum(p.nbytes for p in parts)
        total = HEADER_BYTES + n
        path = self.block_path(ns, key)
        if checksum is not None and checksum[0] in PAYLOAD_ALGOS:
            algo, digest = checksum
        else:
            algo, digest = WRITE_ALGO, checksum_parts(WRITE_ALGO, parts)
        head = pack_header(ns, key, n, digest, algo)
        try:
            if self.min_free_bytes and self.fs_free_bytes() - total < self.min_free_bytes:
                raise OSError(errno.ENOSPC, f"would leave under min_free_bytes="
                                            f"{self.min_free_bytes}")
            self._dirs.ensure(os.path.dirname(path), self.blocks_dir)
            publish(self.new_tmp_path(), path, [memoryview(head), *parts], self.durability,
                    self.syncfs, lambda: self.forget(ns, key))
        except OSError as e:
            raise self._io_error(e, f"writing {n} B a block") from e
        with self._lock:
            self._record(ns, key, n)
            self.bytes_written += total
        return total

    def _io_error(self, e: OSError, what: str) -> DiskIOError:
        with self._lock:
            self.io_errors += 1
        return disk_io_error(e, self.root, what, self.fs_free_bytes)

    # ------------------------------------------------------------ read

    def read_into(self, ns: bytes, key: bytes, out: Any) -> tuple[int, int]:
        """Read the block's payload straight into `out` (a writable buffer of its
        size, or a list: its pieces in order, as arena extents); returns the (algo,
        value) it was verified against. After an error `out` is undefined."""
        dst = ([byte_view(o, writable=True) for o in out] if isinstance(out, list)
               else byte_view(out, writable=True))
        ns, key = check_ns_key(ns, key)
        path = self.layout.block_path(ns, key)
        fd = self._open_block(path, ns, key)
        try:
            h = self._read_fd(path, fd, ns, key, dst)
        finally:
            os.close(fd)
        self._count_read(ns, key, h.payload_bytes)
        return h.algo, h.checksum

    def touch(self, ns: bytes, key: bytes) -> None:
        """Mark the block used now (its mtime: a shared collection's order, collect.py)."""
        try:
            os.utime(self.block_path(ns, key))
        except OSError:
            pass   # deleted meanwhile, or a read-only mount: only the order suffers

    def read(self, ns: bytes, key: bytes) -> bytes:
        """The block's payload (a copy: `read_into` is the fast path)."""
        ns, key = check_ns_key(ns, key)
        path = self.layout.block_path(ns, key)
        fd = self._open_block(path, ns, key)
        try:
            try:
                raw = os.pread(fd, HEADER_FIELDS_BYTES, 0)   # for the payload's size
            except OSError as e:
                raise self._io_error(e, "reading a block") from e
            buf = bytearray(self._check_header(path, fd, parse_header(raw), ns, key).payload_bytes)
            self._read_fd(path, fd, ns, key, memoryview(buf))
        finally:
            os.close(fd)
        self._count_read(ns, key, len(buf))
        return bytes(buf)

    def _read_fd(self, path: str, fd: int, ns: bytes, key: bytes, dst: Buffers) -> Header:
        """The checked read of the block open as `fd` into `dst` (read_block's): its header."""
        try:
            h, digest = read_block(fd, dst)
        except OSError as e:
            raise self._io_error(e, "reading a block") from e
        if h is None or h.ns != ns or h.key != key:
            h = self._check_header(path, fd, h, ns, key)   # raises: not this block
        if digest is None:   # the file, or the caller's buffer, is not the header's size
            nbytes = dst.nbytes if type(dst) is memoryview else sum(d.nbytes for d in dst)
            if h.payload_bytes == nbytes:
                self._corrupt(path, fd, ns, key, "file size differs from its header's")
            if self._file_size(fd) != HEADER_BYTES + h.payload_bytes:
                self._corrupt(path, fd, ns, key, "bad header or truncated file")
            raise ValueError(f"out holds {nbytes} bytes, the block {h.payload_bytes}")
        if digest != h.checksum:
            self._corrupt(path, fd, ns, key, "payload checksum mismatch")
        return h

    def _file_size(self, fd: int) -> int:
        try:
            return os.fstat(fd).st_size
        except OSError as e:
            raise self._io_error(e, "reading a block") from e

    def _open_block(self, path: str, ns: bytes, key: bytes) -> int:
        try:
            return os.open(path, RDONLY)
        except FileNotFoundError:
            self.forget(ns, key)
            raise NotStored("a block is not on the disk tier") from None
        except OSError as e:
            raise self._io_error(e, "reading a block") from e

    def _check_header(self, path: str, fd: int, h: Header | None, ns: bytes,
                      key: bytes) -> Header:
        """The header if it names (ns, key); NotStored for a namespace twin's
        block, CorruptBlock (quarantined) for anything else."""
        if h is not None and h.ns != ns and h.ns[:8] == ns[:8]:
            # Another namespace whose digest shares 64 bits with ours: its
            # block, intact, not ours. A miss, not corruption.
            raise NotStored("a block is not on the disk tier")
        if h is None or h.ns != ns or h.key != key:
            self._corrupt(path, fd, ns, key, "bad header")
        return h

    def _count_read(self, ns: bytes, key: bytes, n: int) -> None:
        with self._lock:
            self.bytes_read += n
            if self._index.get((ns, key)) != n:
                self._record(ns, key, n)

    def _corrupt(self, path: str, fd: int, ns: bytes, key: bytes, why: str) -> NoReturn:
        """Count, quarantine the file open as `fd` (if still at `path`) and raise."""
        with self._lock:
            self.checksum_failures += 1
        # Quarantine only the file we read: a writer may have just replaced it.
        with suppress(OSError):
            st, now = os.fstat(fd), os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                self._quarantine(path)
        self.forget(ns, key)
        raise CorruptBlock(f"a block on the disk tier failed its check ({why}); "
                           "moved to quarantine, treat it as a miss")

    def _quarantine(self, path: str) -> bool:
        """Move a bad block file to quarantine/, keeping its name, plus a timestamp."""
        dst = self.layout.quarantine_path(path)
        try:
            os.rename(path, dst)
        except FileNotFoundError:
            return False  # another daemon moved or deleted it first
        except OSError:
            with self._lock:
                self.io_errors += 1
            return False
        with self._lock:
            self.quarantined += 1
        return True

    def _record(self, ns: bytes, key: bytes, n: int) -> None:
        """Index the block at n payload bytes (with self._lock held, or alone at open)."""
        old = self._index.get((ns, key))
        if old is not None:
            self._used -= HEADER_BYTES + old
        self._index[(ns, key)] = n
        self._used += HEADER_BYTES + n

    def forget(self, ns: bytes, key: bytes) -> None:
        """Drop the block from this daemon's index (its file is gone)."""
        with self._lock:
            self._forgets += 1
            old = self._index.pop((ns, key), None)
            if old is not None:
                self._used -= HEADER_BYTES + old

    # ------------------------------------------------------------ index

    def contains(self, ns: bytes, key: bytes) -> bool:
        """Whether the block is stored: the index, then the file (written by
        another daemon). A stale index hit shows up as NotStored on read."""
        ns, key = check_ns_key(ns, key)
        if (ns, key) in self._index:
            return True
        for _ in range(3):
            forgets = self._forgets
            size = self._file_bytes(ns, key)
            with self._lock:
                if self._forgets != forgets:
                    continue   # a delete ended meanwhile: the stat may be from before it
                if size is not None and (ns, key) not in self._index:
                    self._record(ns, key, size - HEADER_BYTES)
                return size is not None
        return False   # deletes all along: a miss, never a gone file indexed

    def _file_bytes(self, ns: bytes, key: bytes) -> int | None:
        """The block file's size, or None: no file, or too short to serve (a read
        quarantines it)."""
        try:
            st = os.stat(self.block_path(ns, key), follow_symlinks=False)
        except FileNotFoundError:
            return None
        except OSError as e:
            raise self._io_error(e, f"looking up a block") from e
        return st.st_size if st.st_size >= HEADER_BYTES else None

    def indexed_bytes(self, ns: bytes, key: bytes) -> int | None:
        """The payload size this daemon's index records for the block, or None;
        no I/O (call `contains` first to fall back to the file)."""
        return self._index.get(check_ns_key(ns, key))

    def delete(self, ns: bytes, key: bytes) -> int:
        """Remove the block; returns the file bytes freed (0 if it was not there)."""
        ns, key = check_ns_key(ns, key)
        path = self.block_path(ns, key)
        try:
            size = os.stat(path, follow_symlinks=False).st_size
            os.unlink(path)
        except FileNotFoundError:
            size = 0
        except OSError as e:
            raise self._io_error(e, f"deleting a block") from e
        self.forget(ns, key)
        return size

    def __len__(self) -> int:
        return len(self._index)

    @property
    def used_bytes(self) -> int:
        """File bytes (headers + payloads) of the indexed blocks."""
        return self._used

    def fs_free_bytes(self) -> int:
        """Bytes the filesystem under root still gives an unprivileged writer."""
        st = os.statvfs(self.root)
        return st.f_bavail * st.f_frsize

    def iter_index(self) -> Iterator[tuple[bytes, bytes, int]]:
        """(ns, key, payload bytes) of every indexed block, from a snapshot."""
        with self._lock:
            items = list(self._index.items())
        for (ns, key), n in items:
            yield ns, key, n

    def verify_all(self, progress: Callable[[int, int], None] | None = None) -> VerifyReport:
        """Re-check every indexed block's checksum; bad ones are quarantined."""
        return verify_blocks(list(self.iter_index()), self.read_into, self.read, progress)

    # ------------------------------------------------------------ pins

    def pin(self, ns: bytes, key: bytes, owner: str, ttl_s: float,
            now: float | None = None) -> None:
        """Write or refresh `owner`'s pin on the block, valid for ttl_s seconds."""
        ns, key = check_ns_key(ns, key)
        check_owner(owner)
        now = time.time() if now is None else now
        try:
            self._pins.write(ns, key, owner, now + ttl_s)
        except OSError as e:
            raise self._io_error(e, "pinning a block") from e

    def unpin(self, ns: bytes, key: bytes, owner: str) -> None:
        ns, key = check_ns_key(ns, key)
        check_owner(owner)
        self._pins.remove(ns, key, owner)

    def pinned_by_others(self, ns: bytes, key: bytes, owner: str,
                         now: float | None = None) -> bool:
        """Whether an owner other than `owner` holds an unexpired pin on the block."""
        ns, key = check_ns_key(ns, key)
        return self._pins.held_by_others(ns, key, owner, time.time() if now is None else now)

    def delete_if_unpinned(self, ns: bytes, key: bytes, owner: str,
                           now: float | None = None) -> int | None:
        """Delete the block unless another owner pins it: bytes freed, or None if refused."""
        if self.pinned_by_others(ns, key, owner, now):
            return None
        return self.delete(ns, key)

    def sweep_pins(self, now: float | None = None) -> int:
        """Remove expired pins (of any owner); the GC-lock holder runs this.
        Returns how many were removed."""
        removed = self._pins.sweep(time.time() if now is None else now)
        with self._lock:
            self.gc_runs += 1
        return removed
