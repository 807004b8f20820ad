"""Disk tier: one file per block under a directory that several daemons may share.

The directory is a local disk or a shared mount (NFS, CephFS, 3FS-style). This
module is pure synchronous I/O: the daemon calls it from a thread pool, off the
event loop. Calls on different keys may run concurrently from many threads.

Layout under `root`
-------------------

    LAYOUT                                              format version, fan-out depth
    blocks/<ns_hex[:16]>/<kh[0:2]>/<kh>.kvb             one block (kh = key hex)
    tmp/<owner>-<pid>-<rand>.tmp                        files being written
    quarantine/<ns_hex[:16]>.<kh>.kvb.<unix_ms>.<rand>  blocks that failed a check
    pins/<ns_hex[:16]>/<kh[0:2]>/<kh>.<owner>           "owner is using this block"
    gc.lock/<generation:020d>                           garbage-collection lease

Blocks fan out over one level of 256 directories per namespace by default;
with fanout_levels=2 (fixed in LAYOUT when the directory is first opened, so
all daemons agree) the path is blocks/<ns_hex[:16]>/<kh[0:2]>/<kh[2:4]>/<kh>.kvb,
for stores of ~1e8 blocks per namespace. Two levels cost start-up time at
smaller sizes: every near-empty leaf directory is one more directory read
(100k blocks: ~84k leaf dirs, measured 3.2 s of listing alone here, against
~0.05 s for one level). A namespace is named by the first 64 bits of its
digest; the header holds all 128, so a (2^-64) collision reads as a miss.

A path is built only from the hex of the 16-byte namespace digest and of the
key (2..64 bytes), plus the owner id, which is daemon configuration checked
against [A-Za-z0-9_.-]; no client string ever reaches a path. Directories are
never removed: a daemon elsewhere may be about to rename a block into one.

Block file format (little-endian), then the payload:

    offset  size  field
    0       8     magic b"KVKBLOCK"
    8       4     format version (u32, = FORMAT_VERSION)
    12      4     header size (u32, = HEADER_BYTES = 4096; the payload starts here)
    16      16    namespace digest
    32      8     payload length (u64)
    40      8     payload checksum (u64; CRC32 in the low 32 bits)
    48      4     checksum algorithm (u32; 1 = CRC32, as ChecksumAlgo in the API)
    52      2     key length (u16, 2..64)
    54      2     reserved, zero
    56      64    key, zero-padded
    120     4     reserved, zero
    124     4     CRC32 of bytes 0..123 (the header checksum)
    128     3968  zero (reserved)

A file's size is exactly HEADER_BYTES + payload length. The payload starts at
4096 so that it is page-aligned in the file: O_DIRECT and GPUDirect Storage
reads need that, and since KV blocks are multiples of 4 KiB the header costs
exactly one filesystem block, as a 128-byte header pushing the payload's tail
into one more block would too. Start-up reads only the first 128 bytes.

Durability. On a local filesystem `write` puts header and payload in a fresh
tmp file (O_EXCL), renames it over the block's path and calls syncfs(2) once:
one journal commit covers data and rename, half the cost of two fsyncs. A
crash before syncfs returns may leave a torn file, but that write was never
acknowledged and the checksums turn it into a miss. On a network or FUSE
mount (no useful syncfs) it fsyncs the tmp file, renames it over the block's
path and fsyncs the block's directory
(and, once per process, the parents of the fan-out directories it uses), so a
block is either absent or complete after a crash, and present once `write` has
returned. Deletes are not fsynced: a deleted block that comes back after a
crash is still a valid block. Leftover tmp files are removed at open: this
owner's (a previous incarnation's) and anyone's older than `tmp_max_age_s`;
other live daemons' fresh tmp files are left alone.

Integrity. Open rebuilds the index from headers only (magic, version, sizes,
header CRC, path agreement; 100k blocks took ~1.5-2.4 s here from the page
cache, as after kill -9, and ~10-15 s cold); a bad header is quarantined.
Every read checks the header against the requested namespace/key/length and
the payload against its CRC32; a failure raises CorruptBlock and moves the file to quarantine/
(a rename, so the evidence is kept), so a corrupt block is a miss, never data.

Several daemons, one directory. Each keeps its own in-memory index; a miss
falls back to the file, so a block written by daemon A is found by daemon B.
An index hit may be stale (another daemon deleted the file): the read then
raises NotStored and the entry is dropped.

Pins and the GC lock. A daemon that leases a block writes a pin file,
pins/.../<kh>.<owner>, whose content is its expiry (wall-clock seconds of the
writer; wall clocks, not monotonic ones, since pins are compared across
hosts). `delete_if_unpinned` refuses while any other owner's pin is
unexpired. A pin taken before the evictor's check always protects the block;
a pin racing with it can only turn into a miss (NotStored), never wrong data.
One daemon at a time runs garbage collection, chosen by `GcLock`, a lease in
gc.lock/: each acquisition creates the next generation file with O_EXCL, so
of two daemons that both see the current lease expired exactly one creates
generation g+1, and a daemon with a stale view fails on EEXIST instead of
stealing a live lease (a takeover never replaces the holder's file in place).
O_EXCL create and rename are atomic on local filesystems and on NFSv3+/v4 and
CephFS. Expiry times compare the holder's clock with the reader's, so TTLs
must be generous against clock skew (tens of seconds against NTP's
milliseconds) and a holder renews well before expiry (e.g. every ttl/3); a
holder that cannot renew in time must stop collecting. Safety of leased blocks
never rests on the lock alone: pins protect them whoever collects.
"""
from __future__ import annotations

import errno
import os
import re
import secrets
import struct
import threading
import time
import zlib
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, NamedTuple

from kvkeeper.client.arena_format import byte_view

from ..errors import KVKeeperError

MAGIC = b"KVKBLOCK"
FORMAT_VERSION = 1
HEADER_BYTES = 4096         # where the payload starts: page-aligned (see the docstring)
HEADER_FIELDS_BYTES = 128  # the fields; the rest of the header is zero
CHECKSUM_CRC32 = 1  # the API's ChecksumAlgo.CHECKSUM_CRC32
NS_BYTES = 16
MIN_KEY_BYTES, MAX_KEY_BYTES = 2, 64
# One level of 256 dirs per namespace; 2 levels suit stores of ~1e8 blocks per
# namespace, but each of their up to 65536 near-empty leaf dirs costs a
# directory read at start-up (~38 us here: 2.5 s per namespace).
DEFAULT_FANOUT_LEVELS = 1
# magic, version, header size, ns, payload length, checksum, algo, key length,
# reserved u16, key, reserved u32, header crc
HEADER_STRUCT = struct.Struct("<8sII16sQQIHH64sII")
assert HEADER_STRUCT.size == HEADER_FIELDS_BYTES
_HEADER_CRC_AT = HEADER_FIELDS_BYTES - 4
_HEADER_PAD = bytes(HEADER_BYTES - HEADER_FIELDS_BYTES)
BLOCK_SUFFIX = ".kvb"
TMP_SUFFIX = ".tmp"
_OWNER_RE = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}\Z")
_HEX_RE = re.compile(r"[0-9a-f]+\Z")
_CLOEXEC = getattr(os, "O_CLOEXEC", 0)
_NOFOLLOW = getattr(os, "O_NOFOLLOW", 0)
_SCAN_THREADS = 16
_IO_BOUND_S_PER_FILE = 100e-6  # page-cache hits cost ~20 us a file here, device reads ~250
_RDONLY = os.O_RDONLY | _CLOEXEC | _NOFOLLOW
_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})
# Directory fsync is not supported everywhere (some FUSE filesystems); there
# the rename's durability is the filesystem's own business.
_DIR_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EROFS})


# ---------------------------------------------------------------- errors

class TierError(KVKeeperError):
    """A storage backend could not do what was asked."""


class NotStored(TierError):
    """The block is not in this tier (never written, deleted, or quarantined)."""


class CorruptBlock(TierError):
    """The stored block failed its header or payload check; it was quarantined."""


class DiskIOError(TierError):
    """The filesystem failed an operation (EIO and other OSErrors)."""

    def __init__(self, msg: str, errno_: int | None = None) -> None:
        super().__init__(msg)
        self.errno = errno_


class DiskFull(DiskIOError):
    """ENOSPC/EDQUOT: the save failed and nothing was stored; reads still work."""


# ---------------------------------------------------------------- reports

@dataclass
class RecoveryReport:
    blocks: int = 0
    bytes: int = 0            # on disk: headers + payloads
    seconds: float = 0.0
    quarantined: int = 0      # files with a bad header, moved to quarantine/
    tmp_removed: int = 0


@dataclass
class VerifyReport:
    checked: int = 0
    bytes: int = 0            # payload bytes checked
    corrupt: int = 0          # failed and quarantined
    missing: int = 0          # gone meanwhile (deleted by another daemon)
    seconds: float = 0.0


# ---------------------------------------------------------------- header

def pack_header(ns: bytes, key: bytes, payload_bytes: int, crc: int) -> bytes:
    head = HEADER_STRUCT.pack(MAGIC, FORMAT_VERSION, HEADER_BYTES, ns, payload_bytes, crc,
                              CHECKSUM_CRC32, len(key), 0, key, 0, 0)
    return (head[:_HEADER_CRC_AT] + struct.pack("<I", zlib.crc32(head[:_HEADER_CRC_AT]))
            + _HEADER_PAD)


class Header(NamedTuple):
    ns: bytes
    key: bytes
    payload_bytes: int
    crc: int


def parse_header(raw: bytes) -> Header | None:
    """The header in `raw`, or None if it is not a valid version-1 header."""
    if len(raw) != HEADER_FIELDS_BYTES:
        return None
    (magic, version, hsize, ns, plen, crc, algo, klen, _r16, key, _r32,
     hcrc) = HEADER_STRUCT.unpack(raw)
    if (magic != MAGIC or version != FORMAT_VERSION or hsize != HEADER_BYTES
            or algo != CHECKSUM_CRC32 or not MIN_KEY_BYTES <= klen <= MAX_KEY_BYTES
            or crc > 0xFFFFFFFF or zlib.crc32(raw[:_HEADER_CRC_AT]) != hcrc):
        return None
    return Header(ns, key[:klen], plen, crc)


# ---------------------------------------------------------------- helpers

def check_owner(owner: str) -> str:
    if not isinstance(owner, str) or not _OWNER_RE.match(owner):
        raise ValueError(f"owner id {owner!r} must be 1-64 characters of [A-Za-z0-9_.-], "
                         "not starting with '.' or '-'")
    return owner


def check_ns_key(ns: Any, key: Any) -> tuple[bytes, bytes]:
    """ns and key as bytes, or ValueError: only their hex ever reaches a path."""
    if not isinstance(ns, (bytes, bytearray)) or len(ns) != NS_BYTES:
        raise ValueError(f"namespace must be {NS_BYTES} bytes, got {type(ns).__name__} "
                         f"of length {len(ns) if isinstance(ns, (bytes, bytearray)) else '?'}")
    if not isinstance(key, (bytes, bytearray)) or not MIN_KEY_BYTES <= len(key) <= MAX_KEY_BYTES:
        raise ValueError(f"key must be {MIN_KEY_BYTES}..{MAX_KEY_BYTES} bytes, got "
                         f"{type(key).__name__} of length "
                         f"{len(key) if isinstance(key, (bytes, bytearray)) else '?'}")
    return bytes(ns), bytes(key)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | _CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    """pwritev until every byte is written (regular files rarely write short)."""
    off = 0
    bufs = [b for b in bufs if b.nbytes]
    while bufs:
        n = os.pwritev(fd, bufs, off)
        if n <= 0:
            raise OSError(errno.EIO, "pwritev wrote nothing")
        off += n
        while bufs and n >= bufs[0].nbytes:
            n -= bufs[0].nbytes
            bufs.pop(0)
        if n:
            bufs[0] = bufs[0][n:]


def _unlink_quiet(path: str) -> None:
    try:
        os.unlink(path)
    except OSError:
        pass


# ---------------------------------------------------------------- the store

class DiskStore:
    """Blocks in files under one directory. Create with `DiskStore.open`."""

    def __init__(self, root: str, owner_id: str, fsync: bool, min_free_bytes: int,
                 fanout_levels: int) -> None:
        self.root = root
        self.owner_id = owner_id
        self.fanout_levels = fanout_levels
        self.fsync = fsync
        self.min_free_bytes = min_free_bytes
        self.blocks_dir = os.path.join(root, "blocks")
        self.tmp_dir = os.path.join(root, "tmp")
        self.quarantine_dir = os.path.join(root, "quarantine")
        self.pins_dir = os.path.join(root, "pins")
        self.gc_lock = GcLock(os.path.join(root, "gc.lock"), self.tmp_dir)
        self._lock = threading.Lock()
        self._index: dict[tuple[bytes, bytes], int] = {}   # (ns, key) -> payload bytes
        self._used = 0                                      # file bytes of indexed blocks
        self._synced_dirs: set[str] = set()                 # fan-out dirs whose parents are fsynced
        self._pid = os.getpid()
        # syncfs(2) when the directory is local; per-file and directory fsync otherwise.
        self.syncfs: Callable[[str], None] | None = None
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
        `scan_threads` None (auto): threads on a network or FUSE mount, where
        each open is a round trip; on a local filesystem serial while headers
        come from the page cache (a restart after kill -9: threads would only
        fight over the GIL), threads once reads wait on the device (cold cache).
        """
        check_owner(owner_id)
        if min_free_bytes < 0:
            raise ValueError(f"min_free_bytes must be >= 0, got {min_free_bytes}")
        if fanout_levels not in (None, 1, 2):
            raise ValueError(f"fanout_levels must be 1 or 2, got {fanout_levels!r}")
        t0 = time.perf_counter()
        root = os.path.abspath(root)
        for d in (root, *(os.path.join(root, s) for s in ("blocks", "tmp", "quarantine", "pins",
                                                           "gc.lock"))):
            os.makedirs(d, mode=0o750, exist_ok=True)
        levels = _layout(root, fanout_levels)
        store = cls(root, owner_id, fsync, min_free_bytes, levels)
        if fsync and not is_remote_fs(root):
            store.syncfs = _syncfs()
        report = RecoveryReport()
        report.tmp_removed = store._clean_tmp(tmp_max_age_s)
        if scan_threads is None and is_remote_fs(root):
            scan_threads = _SCAN_THREADS
        store._scan(report, scan_threads)
        report.blocks = len(store._index)
        report.bytes = store._used
        report.seconds = time.perf_counter() - t0
        return store, report

    def _clean_tmp(self, max_age_s: float) -> int:
        """Remove our own leftover tmp files and anyone's older than max_age_s.
        A fresh tmp file of another owner may be a live daemon's write in progress."""
        removed = 0
        cutoff = time.time() - max_age_s
        mine = self.owner_id + "-"
        with os.scandir(self.tmp_dir) as it:
            for e in it:
                if not e.name.endswith(TMP_SUFFIX):
                    continue
                owner = e.name[:-len(TMP_SUFFIX)].rsplit("-", 2)[0]
                try:
                    stale = (owner + "-" == mine) or e.stat(follow_symlinks=False).st_mtime < cutoff
                    if stale:
                        os.unlink(e.path)
                        removed += 1
                except FileNotFoundError:
                    pass  # removed by another daemon meanwhile
        return removed

    def _scan(self, report: RecoveryReport, threads: int | None) -> None:
        # One task per namespace fan-out dir: coarse enough that thread hand-off
        # costs nothing, fine enough to spread a shared mount's latency.
        tasks = [(a.path, ns_e.name, a.name)
                 for ns_e in _subdirs(self.blocks_dir, 16) for a in _subdirs(ns_e.path, 2)]
        results = []
        done = 0
        if threads is None:
            # Serial while headers come from the page cache (threads would only
            # fight over the GIL); parallel once reads wait on the device.
            t0, files = time.perf_counter(), 0
            while done < len(tasks):
                found, bad = self._scan_tree(*tasks[done])
                results.append((found, bad))
                done += 1
                files += len(found) + len(bad)
                if files >= 256 and (time.perf_counter() - t0) / files > _IO_BOUND_S_PER_FILE:
                    break
            threads = _SCAN_THREADS
        rest = tasks[done:]
        if threads > 1 and len(rest) > 1:
            with ThreadPoolExecutor(max_workers=threads) as ex:
                results.extend(ex.map(lambda t: self._scan_tree(*t), rest))
        else:
            results.extend(self._scan_tree(*t) for t in rest)
        for found, bad in results:
            for ns, key, plen in found:
                self._index[(ns, key)] = plen
                self._used += HEADER_BYTES + plen
            for path in bad:
                if self._quarantine(path):
                    report.quarantined += 1

    def _scan_tree(self, top: str, ns_name: str, prefix: str
                   ) -> tuple[list[tuple[bytes, bytes, int]], list[str]]:
        """Index the blocks under one first-level fan-out dir (and its
        subdirs, with FANOUT_LEVELS > 1): headers only, no payload."""
        found: list[tuple[bytes, bytes, int]] = []
        bad: list[str] = []
        leaves = [(top, prefix)]
        for _ in range(self.fanout_levels - 1):
            leaves = [(e.path, pre + e.name) for d, pre in leaves for e in _subdirs(d, 2)]
        for leaf, pre in leaves:
            try:
                with os.scandir(leaf) as it:
                    names = [e.name for e in it]
            except FileNotFoundError:
                continue
            for name in names:
                if not name.endswith(BLOCK_SUFFIX):
                    continue  # e.g. NFS .nfsXXXX files: not ours to judge
                kh = name[:-4]
                path = f"{leaf}/{name}"
                try:
                    fd = os.open(path, _RDONLY)
                except FileNotFoundError:
                    continue  # deleted by another daemon meanwhile
                except OSError:
                    bad.append(path)  # e.g. a symlink: nothing we wrote
                    continue
                try:
                    raw = os.pread(fd, HEADER_FIELDS_BYTES, 0)
                    size = os.fstat(fd).st_size
                finally:
                    os.close(fd)
                h = parse_header(raw)
                # The name must be the header's key and sit where block_path puts it.
                if (h is None or size != HEADER_BYTES + h[2] or h[1].hex() != kh
                        or not kh.startswith(pre) or h[0].hex()[:16] != ns_name):
                    bad.append(path)
                    continue
                found.append(h[:3])
        return found, bad

    # ------------------------------------------------------------ paths

    def block_path(self, ns: bytes, key: bytes) -> str:
        ns, key = check_ns_key(ns, key)
        kh = key.hex()
        fan = [kh[2 * i:2 * i + 2] for i in range(self.fanout_levels)]
        return os.path.join(self.blocks_dir, ns.hex()[:16], *fan, kh + BLOCK_SUFFIX)

    def _pin_dir(self, ns: bytes, key: bytes) -> str:
        return os.path.join(self.pins_dir, ns.hex()[:16], key.hex()[0:2])

    def _tmp_path(self) -> str:
        return os.path.join(self.tmp_dir,
                            f"{self.owner_id}-{self._pid}-{secrets.token_hex(8)}{TMP_SUFFIX}")

    def _ensure_dirs(self, leaf: str, top: str) -> None:
        """Create the fan-out dirs from `top` down to `leaf`, each with its
        parent fsynced once per process, so a renamed-in block is reachable
        after a crash."""
        if leaf in self._synced_dirs:
            return
        rel = os.path.relpath(leaf, top).split(os.sep)
        path = top
        for part in rel:
            path = os.path.join(path, part)
            if path in self._synced_dirs:
                continue
            try:
                os.mkdir(path, 0o750)
            except FileExistsError:
                pass
            if self.fsync:
                _fsync_dir(os.path.dirname(path))
            with self._lock:
                self._synced_dirs.add(path)

    # ------------------------------------------------------------ write

    def write(self, ns: bytes, key: bytes, data: Any) -> int:
        """Store `data` as the block (ns, key), durably; returns bytes on disk.
        Writing an existing key replaces it (the last rename wins)."""
        ns, key = check_ns_key(ns, key)
        src = byte_view(data)
        n = src.nbytes
        total = HEADER_BYTES + n
        path = self.block_path(ns, key)
        head = pack_header(ns, key, n, zlib.crc32(src) & 0xFFFFFFFF)
        tmp = self._tmp_path()
        fd = -1
        renamed = False
        try:
            if self.min_free_bytes:
                free = self.fs_free_bytes()
                if free - total < self.min_free_bytes:
                    raise OSError(errno.ENOSPC, f"would leave under min_free_bytes="
                                                f"{self.min_free_bytes}")
            self._ensure_dirs(os.path.dirname(path), self.blocks_dir)
            fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC | _NOFOLLOW, 0o640)
            _write_all(fd, [memoryview(head), src])
            if self.fsync and self.syncfs is None:
                os.fsync(fd)
            os.close(fd)   # NFS reports deferred write errors here
            fd = -1
            os.replace(tmp, path)
            renamed = True
            if self.fsync:
                if self.syncfs is not None:
                    # One flush of the filesystem makes data and rename durable
                    # together (one journal commit instead of two). A crash before
                    # it returns can leave a torn file, but the write was not yet
                    # acknowledged and the CRCs turn a torn file into a miss.
                    self.syncfs(os.path.dirname(path))
                else:
                    _fsync_dir(os.path.dirname(path))
        except OSError as e:
            if fd >= 0:
                try:
                    os.close(fd)
                except OSError:
                    pass
            _unlink_quiet(tmp)
            if renamed:
                # Published but not known durable: a failed write leaves no block.
                _unlink_quiet(path)
                self._forget(ns, key)
            raise self._io_error(e, f"writing {n} B a block") from e
        with self._lock:
            old = self._index.get((ns, key))
            if old is not None:
                self._used -= HEADER_BYTES + old
            self._index[(ns, key)] = n
            self._used += total
            self.bytes_written += total
        return total

    def _io_error(self, e: OSError, what: str) -> DiskIOError:
        with self._lock:
            self.io_errors += 1
        if e.errno in _FULL_ERRNOS:
            try:
                free = f"{self.fs_free_bytes()} B free"
            except OSError:
                free = "free space unknown"
            return DiskFull(
                f"disk tier at {self.root} is full: {what} failed ({os.strerror(e.errno)}; "
                f"{e.strerror}); the filesystem has {free}. Nothing was stored; reads go on. "
                "Free space, lower the disk tier's capacity, or let eviction run", e.errno)
        return DiskIOError(f"disk tier at {self.root}: {what} failed: {e}", e.errno)

    # ------------------------------------------------------------ read

    def read_into(self, ns: bytes, key: bytes, out: Any) -> None:
        """Read the block's payload straight into `out`, a writable buffer of
        exactly its size. On CorruptBlock the content of `out` is undefined."""
        dst = byte_view(out, writable=True)
        self._read(ns, key, dst)

    def read(self, ns: bytes, key: bytes) -> bytes:
        """The block's payload."""
        data = self._read(ns, key, None)
        assert data is not None
        return data

    def _read(self, ns: Any, key: Any, dst: memoryview | None) -> bytes | None:
        ns, key = check_ns_key(ns, key)
        path = self.block_path(ns, key)
        what = f"reading a block"
        try:
            fd = os.open(path, os.O_RDONLY | _CLOEXEC | _NOFOLLOW)
        except FileNotFoundError:
            self._forget(ns, key)
            raise NotStored(f"a block is not on the disk tier") from None
        except OSError as e:
            raise self._io_error(e, what) from e
        try:
            try:
                raw = os.pread(fd, HEADER_FIELDS_BYTES, 0)
                st = os.fstat(fd)
            except OSError as e:
                raise self._io_error(e, what) from e
            h = parse_header(raw)
            if h is not None and h.ns != ns and h.ns.hex()[:16] == ns.hex()[:16]:
                # Another namespace whose digest shares 64 bits with ours: its
                # block, intact, not ours. A miss, not corruption.
                raise NotStored(f"a block is not on the disk tier")
            if h is None or h.ns != ns or h.key != key or st.st_size != HEADER_BYTES + h.payload_bytes:
                self._corrupt(path, st, ns, key, "bad header or truncated file")
            assert h is not None
            n = h.payload_bytes
            if dst is not None and dst.nbytes != n:
                raise ValueError(f"out holds {dst.nbytes} bytes, the block {n}")
            data: bytes | None = None
            try:
                if dst is None:
                    data = _pread_all(fd, n)
                    got, view = len(data), memoryview(data)
                else:
                    got, view = _preadv_all(fd, dst), dst
            except OSError as e:
                raise self._io_error(e, what) from e
            if got != n:
                self._corrupt(path, st, ns, key, "file shrank while being read")
            if zlib.crc32(view) & 0xFFFFFFFF != h.crc:
                self._corrupt(path, st, ns, key, "payload checksum mismatch")
        finally:
            os.close(fd)
        with self._lock:
            self.bytes_read += n
            if self._index.get((ns, key)) != n:
                old = self._index.get((ns, key))
                if old is not None:
                    self._used -= HEADER_BYTES + old
                self._index[(ns, key)] = n
                self._used += HEADER_BYTES + n
        return data

    def _corrupt(self, path: str, st: os.stat_result, ns: bytes, key: bytes, why: str) -> None:
        with self._lock:
            self.checksum_failures += 1
        # Quarantine only the file we read: a writer may have just replaced it.
        try:
            now = os.stat(path, follow_symlinks=False)
            if (now.st_dev, now.st_ino) == (st.st_dev, st.st_ino):
                self._quarantine(path)
        except OSError:
            pass
        self._forget(ns, key)
        raise CorruptBlock(f"a block on the disk tier failed its check ({why}); "
                           "moved to quarantine, treat it as a miss")

    def _quarantine(self, path: str) -> bool:
        """Move a bad block file to quarantine/, keeping its name, plus a timestamp."""
        ns_name = os.path.relpath(path, self.blocks_dir).split(os.sep)[0]
        dst = os.path.join(self.quarantine_dir, f"{ns_name}.{os.path.basename(path)}."
                                                f"{int(time.time() * 1000)}.{secrets.token_hex(4)}")
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

    def _forget(self, ns: bytes, key: bytes) -> None:
        with self._lock:
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
        try:
            st = os.stat(self.block_path(ns, key), follow_symlinks=False)
        except FileNotFoundError:
            return False
        except OSError as e:
            raise self._io_error(e, f"looking up a block") from e
        if st.st_size < HEADER_BYTES:
            return False  # not a block we could serve; a read quarantines it
        with self._lock:
            if (ns, key) not in self._index:
                self._index[(ns, key)] = st.st_size - HEADER_BYTES
                self._used += st.st_size
        return True

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
        self._forget(ns, key)
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
        t0 = time.perf_counter()
        rep = VerifyReport()
        items = list(self.iter_index())
        buf = bytearray(max((n for _, _, n in items), default=0))
        mv = memoryview(buf)
        for i, (ns, key, n) in enumerate(items):
            try:
                self._read(ns, key, mv[:n])
                rep.checked += 1
                rep.bytes += n
            except CorruptBlock:
                rep.corrupt += 1
            except NotStored:
                rep.missing += 1
            except ValueError:
                # Rewritten with another size since the snapshot: read it as it is now.
                try:
                    rep.bytes += len(self.read(ns, key))
                    rep.checked += 1
                except CorruptBlock:
                    rep.corrupt += 1
                except NotStored:
                    rep.missing += 1
            if progress is not None:
                progress(i + 1, len(items))
        rep.seconds = time.perf_counter() - t0
        return rep

    # ------------------------------------------------------------ pins

    def pin(self, ns: bytes, key: bytes, owner: str, ttl_s: float,
            now: float | None = None) -> None:
        """Write or refresh `owner`'s pin on the block, valid for ttl_s seconds."""
        ns, key = check_ns_key(ns, key)
        check_owner(owner)
        now = time.time() if now is None else now
        d = self._pin_dir(ns, key)
        tmp = self._tmp_path()
        try:
            self._ensure_dirs(d, self.pins_dir)
            with open(tmp, "x") as f:
                f.write(f"{now + ttl_s:.3f}\n")
            os.replace(tmp, os.path.join(d, f"{key.hex()}.{owner}"))
        except OSError as e:
            _unlink_quiet(tmp)
            raise self._io_error(e, f"pinning a block") from e

    def unpin(self, ns: bytes, key: bytes, owner: str) -> None:
        ns, key = check_ns_key(ns, key)
        check_owner(owner)
        _unlink_quiet(os.path.join(self._pin_dir(ns, key), f"{key.hex()}.{owner}"))

    def pinned_by_others(self, ns: bytes, key: bytes, owner: str,
                         now: float | None = None) -> bool:
        """Whether an owner other than `owner` holds an unexpired pin on the block."""
        ns, key = check_ns_key(ns, key)
        now = time.time() if now is None else now
        prefix = key.hex() + "."
        try:
            entries = list(os.scandir(self._pin_dir(ns, key)))
        except FileNotFoundError:
            return False
        for e in entries:
            if not e.name.startswith(prefix) or e.name[len(prefix):] == owner:
                continue
            expires = _pin_expiry(e.path)
            if expires is None:
                continue  # gone meanwhile
            if expires > now:
                return True
        return False

    def delete_if_unpinned(self, ns: bytes, key: bytes, owner: str,
                           now: float | None = None) -> int | None:
        """Delete the block unless another owner pins it: bytes freed, or None if refused."""
        if self.pinned_by_others(ns, key, owner, now):
            return None
        return self.delete(ns, key)

    def sweep_pins(self, now: float | None = None) -> int:
        """Remove expired pins (of any owner); the GC-lock holder runs this.
        Returns how many were removed."""
        now = time.time() if now is None else now
        removed = 0
        for ns_e in _subdirs(self.pins_dir, 16):
            for a in _subdirs(ns_e.path, 2):
                with os.scandir(a.path) as it:
                    for e in it:
                        expires = _pin_expiry(e.path)
                        if expires is not None and expires <= now:
                            _unlink_quiet(e.path)
                            removed += 1
        with self._lock:
            self.gc_runs += 1
        return removed


def _pin_expiry(path: str) -> float | None:
    """A pin's expiry; +inf if unreadable garbage (pins are written by rename,
    so garbage means damage: keep protecting rather than guess); None if gone."""
    try:
        with open(path, "rb") as f:
            raw = f.read(64)
    except FileNotFoundError:
        return None
    except OSError:
        return float("inf")
    try:
        return float(raw.split()[0])
    except (ValueError, IndexError):
        return float("inf")


_REMOTE_FS = ("nfs", "nfs4", "ceph", "cifs", "smb3", "lustre", "gpfs", "beegfs", "9p",
              "glusterfs", "virtiofs")


def _syncfs() -> Callable[[str], None] | None:
    """syncfs(2) of the filesystem holding a directory, or None where unavailable."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.syncfs
    except (OSError, AttributeError):
        return None

    def syncfs(directory: str) -> None:
        dfd = os.open(directory, os.O_RDONLY | _CLOEXEC)
        try:
            if fn(dfd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        finally:
            os.close(dfd)

    return syncfs


def is_remote_fs(path: str) -> bool:
    """Whether `path` lies on a network or FUSE filesystem (per /proc/self/mountinfo)."""
    real = os.path.realpath(path)
    best, fstype = "", ""
    try:
        with open("/proc/self/mountinfo") as f:
            for line in f:
                left, _, right = line.partition(" - ")
                fields = left.split()
                if len(fields) < 5 or not right:
                    continue
                mnt = fields[4].replace("\\040", " ")
                if (real == mnt or real.startswith(mnt.rstrip("/") + "/")) and len(mnt) >= len(best):
                    best, fstype = mnt, right.split()[0]
    except OSError:
        return False
    return fstype in _REMOTE_FS or fstype.startswith("fuse")


_LAYOUT_MAGIC = "kvkeeper-disk-layout"


def _layout(root: str, want: int | None) -> int:
    """The fan-out depth recorded in root/LAYOUT, which the first daemon to
    open the directory writes (O_EXCL): every daemon sharing it must agree."""
    path = os.path.join(root, "LAYOUT")
    text = f"{_LAYOUT_MAGIC} {FORMAT_VERSION} fanout_levels={want or DEFAULT_FANOUT_LEVELS}\n"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o640)
    except FileExistsError:
        pass
    else:
        try:
            os.write(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        _fsync_dir(root)
    for _ in range(50):  # another daemon may be writing it right now
        with open(path) as f:
            have = f.read(200)
        if have.endswith("\n"):
            break
        time.sleep(0.05)
    m = re.fullmatch(rf"{_LAYOUT_MAGIC} (\d+) fanout_levels=([12])\n", have)
    if m is None or int(m.group(1)) != FORMAT_VERSION:
        raise ValueError(f"{path} reads {have!r}: not a kvkeeper disk tier of format "
                         f"{FORMAT_VERSION}; point the disk tier at another directory")
    levels = int(m.group(2))
    if want is not None and want != levels:
        raise ValueError(f"{root} was created with fanout_levels={levels}, not {want}; "
                         "use the recorded value or another directory")
    return levels


def _subdirs(path: str, name_len: int) -> list[os.DirEntry]:
    """Subdirectories of `path` whose names are `name_len` lowercase hex digits."""
    try:
        with os.scandir(path) as it:
            return [e for e in it if len(e.name) == name_len and _HEX_RE.match(e.name)
                    and e.is_dir(follow_symlinks=False)]
    except FileNotFoundError:
        return []


def _pread_all(fd: int, n: int) -> bytes:
    data = os.pread(fd, n, HEADER_BYTES)
    if len(data) == n or not data:
        return data
    parts = [data]
    got = len(data)
    while got < n:
        more = os.pread(fd, n - got, HEADER_BYTES + got)
        if not more:
            break
        parts.append(more)
        got += len(more)
    return b"".join(parts)


def _preadv_all(fd: int, dst: memoryview) -> int:
    """Fill dst from the payload; returns the bytes read (< nbytes at EOF)."""
    got = 0
    n = dst.nbytes
    while got < n:
        k = os.preadv(fd, [dst[got:]], HEADER_BYTES + got)
        if k <= 0:
            break
        got += k
    return got


# ---------------------------------------------------------------- GC lock

@dataclass(frozen=True)
class LockHolder:
    owner: str
    expires_at: float     # wall clock of the holder; 0 once released
    token: str
    generation: int


class GcLock:
    """A lease naming the one daemon that garbage-collects the shared directory.

    gc.lock/ holds generation files <g:020d>, each "kvkgc1 <owner> <expires_at>
    <token>". The holder is the highest generation. To acquire, a daemon that
    sees no holder, an expired or released one, creates generation g+1 with
    O_EXCL: one winner per generation; losers (and daemons with a stale view
    of g) get EEXIST, and a winner checks afterwards that no newer generation
    exists. Generations only grow (the winner prunes all but the last few
    below it; the newest is never removed, only rewritten by its holder via
    rename), so a number is never reused. The holder renews by rewriting its
    own file, and checks it is still the newest. On NFS a directory listing
    may be cached: `holder` also probes g+1, g+2.. by name.
    """

    _MAGIC = "kvkgc1"
    _WRITE_GRACE_S = 60.0  # a file still empty after this long: its creator died mid-write
    _KEEP = 8              # generations kept below the newest: a stale creator hits EEXIST

    def __init__(self, dir_path: str, tmp_dir: str) -> None:
        self.dir = dir_path
        self.tmp_dir = tmp_dir
        self._held: dict[str, LockHolder] = {}
        self._mu = threading.Lock()

    def holder(self) -> LockHolder | None:
        """The newest generation's content (None if there is none)."""
        for _ in range(8):
            try:
                gens = [int(n) for n in os.listdir(self.dir) if len(n) == 20 and n.isdigit()]
            except FileNotFoundError:
                return None
            if not gens:
                return None
            g = max(gens)
            while os.path.exists(self._path(g + 1)):  # newer than a cached listing showed
                g += 1
            path = self._path(g)
            try:
                with open(path) as f:
                    text = f.read(512)
                mtime = os.stat(path).st_mtime
            except FileNotFoundError:
                continue  # superseded and removed meanwhile: list again
            parts = text.split()
            try:
                if len(parts) != 4 or parts[0] != self._MAGIC:
                    raise ValueError(text)
                return LockHolder(parts[1], float(parts[2]), parts[3], g)
            except ValueError:
                # Being written right now, or its creator died mid-write.
                return LockHolder("?", mtime + self._WRITE_GRACE_S, "", g)
        raise DiskIOError(f"gc lock in {self.dir} keeps changing; try again")

    def try_acquire(self, owner: str, ttl_s: float, now: float | None = None) -> bool:
        """Become the GC owner for ttl_s seconds if no one else holds a live lease."""
        check_owner(owner)
        now = time.time() if now is None else now
        with self._mu:
            cur = self.holder()
            mine = self._held.pop(owner, None)
            if (cur is not None and mine is not None and cur.token == mine.token
                    and now < mine.expires_at):
                self._held[owner] = mine
                return self._renew_locked(owner, ttl_s, now)
            if cur is not None and cur.expires_at > now and cur.owner != owner:
                return False
            # Free, expired, released, or our own (previous incarnation's) lease:
            # the next generation, never the current file in place.
            g = (cur.generation if cur is not None else 0) + 1
            token = secrets.token_hex(8)
            try:
                fd = os.open(self._path(g), os.O_WRONLY | os.O_CREAT | os.O_EXCL | _CLOEXEC, 0o640)
            except FileExistsError:
                return False
            try:
                os.write(fd, self._content(owner, now + ttl_s, token).encode())
                os.fsync(fd)
            finally:
                os.close(fd)
            # A daemon whose view was generations behind may have created a
            # generation that the newest winner's pruning had removed: it is
            # not the newest, so it lost.
            cur = self.holder()
            if cur is None or cur.generation != g or cur.token != token:
                return False
            self._held[owner] = LockHolder(owner, now + ttl_s, token, g)
            for name in os.listdir(self.dir):
                if len(name) == 20 and name.isdigit() and int(name) < g - self._KEEP:
                    _unlink_quiet(os.path.join(self.dir, name))
            return True

    def renew(self, owner: str, ttl_s: float, now: float | None = None) -> bool:
        """Extend our lease; False if it was lost (expired or taken over): stop collecting."""
        now = time.time() if now is None else now
        with self._mu:
            return self._renew_locked(owner, ttl_s, now)

    def _renew_locked(self, owner: str, ttl_s: float, now: float) -> bool:
        mine = self._held.get(owner)
        if mine is None:
            return False
        cur = self.holder()
        if now >= mine.expires_at or cur is None or cur.token != mine.token:
            del self._held[owner]
            return False
        self._rewrite(mine.generation, owner, now + ttl_s, mine.token)
        cur = self.holder()
        if cur is None or cur.generation != mine.generation:
            del self._held[owner]
            return False
        self._held[owner] = LockHolder(owner, now + ttl_s, mine.token, mine.generation)
        return True

    def release(self, owner: str) -> None:
        """Give the lease up (marks it released so another daemon takes it at once)."""
        with self._mu:
            mine = self._held.pop(owner, None)
            if mine is None:
                return
            cur = self.holder()
            if cur is not None and cur.token == mine.token:
                self._rewrite(mine.generation, owner, 0.0, mine.token)

    def _path(self, g: int) -> str:
        return os.path.join(self.dir, f"{g:020d}")

    def _content(self, owner: str, expires_at: float, token: str) -> str:
        return f"{self._MAGIC} {owner} {expires_at:.3f} {token}\n"

    def _rewrite(self, g: int, owner: str, expires_at: float, token: str) -> None:
        tmp = os.path.join(self.tmp_dir, f"{owner}-{os.getpid()}-{secrets.token_hex(8)}{TMP_SUFFIX}")
        try:
            with open(tmp, "x") as f:
                f.write(self._content(owner, expires_at, token))
                f.flush()
                os.fsync(f.fileno())
            os.replace(tmp, self._path(g))
        except BaseException:
            _unlink_quiet(tmp)
            raise
