"""How a write becomes durable: syncfs(2) on a local filesystem, per-file and
directory fsync on a network or FUSE mount, and which of the two a path is on.

On a local filesystem `DiskStore.write` puts header and payload in a fresh
tmp file (O_EXCL), renames it over the block's path and calls syncfs(2) once:
one journal commit covers data and rename, half the cost of two fsyncs. A
crash before syncfs returns may leave a torn file, but that write was never
acknowledged and the checksums turn it into a miss. On a network or FUSE
mount (no useful syncfs) it fsyncs the tmp file, renames it over the block's
path and fsyncs the block's directory (and, once per process, the parents of
the fan-out directories it uses: `DurableDirs`), so a block is either absent
or complete after a crash, and present once `write` has returned. Deletes are
not fsynced: a deleted block that comes back after a crash is still a valid
block.
"""
from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable

from .fileio import CLOEXEC

# Directory fsync is not supported everywhere (some FUSE filesystems); there
# the rename's durability is the filesystem's own business.
_DIR_FSYNC_UNSUPPORTED = frozenset({errno.EINVAL, errno.ENOTSUP, errno.EBADF, errno.EROFS})

_REMOTE_FS = ("nfs", "nfs4", "ceph", "cifs", "smb3", "lustre", "gpfs", "beegfs", "9p",
              "glusterfs", "virtiofs")


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


class DurableDirs:
    """Fan-out directories created on demand, each with its parent fsynced
    once per process (when `fsync`), so a block or pin renamed into one is
    reachable after a crash. Safe to call from many threads."""

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
