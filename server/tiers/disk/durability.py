"""How a write becomes durable, on which filesystem: the three orders of
`DiskStore.write` (`publish`), and which one a path gets.

Every write puts header and payload in a fresh tmp file (O_EXCL) and renames
it over the block's path; what makes that durable before `write` returns:

- FSYNC_AFTER_RENAME (ext4, XFS, btrfs): rename, then fsync the file. There
  fsync persists the inode's latest change, the rename included: ext4 and XFS
  commit the journal transaction that holds it (one commit for data and
  name), btrfs logs the new name with the inode, and ext4 without a journal
  syncs the directory of a not-yet-synced inode's new entry, which after the
  rename is the block's directory (ext4_sync_parent). That is the guarantee
  a plain create + write + fsync of a new file already relies on for its
  name, at the same cost: one flush. The two orders below cost up to twice
  that (two flushes, or a whole-filesystem sync that also waits for every
  other process's dirty data on it).
- SYNCFS (other local filesystems): rename, then syncfs(2) once.
- FSYNC_AND_DIR (network and FUSE mounts, or where syncfs is missing): fsync
  the tmp file, rename, fsync the block's directory.

In the first two a crash before `write` returns may leave a torn file under
the block's name, but that write was never acknowledged and the checksums
turn a torn file into a miss. Fan-out directories are made durable before a
block is renamed into them (`DurableDirs`). Deletes are not fsynced: a
deleted block that comes back after a crash is still a valid block.
"""
from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable

from .fileio import CLOEXEC, NOFOLLOW, unlink_quiet, write_all

# Directory fsync is not supported everywhere (some FUSE filesystems); there
# the rename's durability is the filesystem's own business.
_DIR_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EROFS})

_REMOTE_FS = ("nfs", "nfs4", "ceph", "cifs", "smb3", "lustre", "gpfs", "beegfs", "9p",
              "glusterfs", "virtiofs")


def publish(tmp: str, path: str, bufs: list[memoryview], durability: str,
            syncfs: Callable[[str], None] | None, unpublished: Callable[[], None]) -> None:
    """Write `bufs` into a new file `tmp` and rename it to `path`, durable as
    `durability` says (the orders above). On OSError nothing of this write
    is left: the tmp file is removed, and so is `path` where the rename had
    happened (published but not known durable: a failed write leaves no
    block), `unpublished()` then called for it."""
    fd = -1
    renamed = False
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | CLOEXEC | NOFOLLOW, 0o640)
        write_all(fd, bufs)
        if durability == FSYNC_AFTER_RENAME:
            os.replace(tmp, path)   # then one fsync for data and name
            renamed = True
            os.fsync(fd)
        elif durability == FSYNC_AND_DIR:
            os.fsync(fd)
        os.close(fd)   # NFS reports deferred write errors here
        fd = -1
        if not renamed:
            os.replace(tmp, path)
            renamed = True
            if durability == SYNCFS and syncfs is not None:
                syncfs(os.path.dirname(path))
            elif durability == FSYNC_AND_DIR:
                fsync_dir(os.path.dirname(path))
    except OSError:
        if fd >= 0:
            try:
                os.close(fd)
            except OSError:
                pass
        unlink_quiet(tmp)
        if renamed:
            unlink_quiet(path)
            unpublished()
        raise


def fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | CLOEXEC)
    try:
        os.fsync(fd)
    except OSError as e:
        if e.errno not in _DIR_FSYNC_UNSUPPORTED:
            raise
    finally:
        os.close(fd)


def find_syncfs() -> Callable[[str], None] | None:
    """syncfs(2) of the filesystem holding a directory, or None where unavailable."""
    import ctypes
    import ctypes.util
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = libc.syncfs
    except (OSError, AttributeError):
        return None

    def syncfs(directory: str) -> None:
        dfd = os.open(directory, os.O_RDONLY | CLOEXEC)
        try:
            if fn(dfd) != 0:
                err = ctypes.get_errno()
                raise OSError(err, os.strerror(err))
        finally:
            os.close(dfd)

    return syncfs


FSYNC_AFTER_RENAME = "fsync-after-rename"
SYNCFS = "syncfs"
FSYNC_AND_DIR = "fsync-and-dir"
NO_SYNC = "none"   # fsync=False: tests and benchmarks that measure everything else
# Local filesystems whose fsync of a file persists its latest rename (see above).
_FSYNC_PERSISTS_RENAME = frozenset({"ext4", "xfs", "btrfs"})


def mount_fstype(path: str) -> str:
    """The type of the filesystem holding `path` (per /proc/self/mountinfo),
    or "" when that cannot be read."""
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
        return ""
    return fstype


def is_remote(fstype: str) -> bool:
    """Whether a filesystem of this type is a network or FUSE one."""
    return fstype in _REMOTE_FS or fstype.startswith("fuse")


def is_remote_fs(path: str) -> bool:
    """Whether `path` lies on a network or FUSE filesystem."""
    return is_remote(mount_fstype(path))


def durability_for(fstype: str, fsync: bool) -> tuple[str, Callable[[str], None] | None]:
    """Which write order (FSYNC_AFTER_RENAME, SYNCFS, FSYNC_AND_DIR, NO_SYNC)
    a store on a filesystem of type `fstype` uses, and the syncfs for SYNCFS."""
    if not fsync:
        return NO_SYNC, None
    if is_remote(fstype):
        return FSYNC_AND_DIR, None
    if fstype in _FSYNC_PERSISTS_RENAME:
        return FSYNC_AFTER_RENAME, None
    syncfs = find_syncfs()
    return (SYNCFS, syncfs) if syncfs is not None else (FSYNC_AND_DIR, None)


class DurableDirs:
    """Fan-out directories created on demand, each with its parent fsynced
    once per process (when `fsync`), so a block or pin renamed into one is
    reachable after a crash. Safe to call from many threads.

    A store writing FSYNC_AFTER_RENAME passes fsync=False: there the block's
    own fsync also persists the new directories above it (the journal commits
    in order; ext4 without a journal syncs every parent of a new entry up the
    chain), and the directory fsync cost a flush of its own on a namespace's
    first ~256 writes. Directories are made one by one as needed, not all 256
    at once: a mkdir here cost ~0.5 ms (the 256 of a fan-out ~150 ms)."""

    def __init__(self, fsync: bool) -> None:
        self.fsync = fsync
        self._lock = threading.Lock()
        self._synced: set[str] = set()   # dirs whose parents are fsynced

    def ensure(self, leaf: str, top: str) -> None:
        """Create the fan-out dirs from `top` down to `leaf`."""
        if leaf in self._synced:
            return
        rel = os.path.relpath(leaf, top).split(os.sep)
        path = top
        for part in rel:
            path = os.path.join(path, part)
            if path in self._synced:
                continue
            try:
                os.mkdir(path, 0o750)
            except FileExistsError:
                pass
            if self.fsync:
                fsync_dir(os.path.dirname(path))
            with self._lock:
                self._synced.add(path)
