"""What a disk-tier operation raises, split by what went wrong.

NotStored and CorruptBlock are misses to the caller (a corrupt block is never
served as data); DiskIOError is the filesystem failing, DiskFull the one such
failure an operator fixes by freeing space; `disk_io_error` tells them apart.
"""
from __future__ import annotations

import errno
import os
from collections.abc import Callable

from ...errors import KVKeeperError

_FULL_ERRNOS = frozenset({errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)})


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


def disk_io_error(e: OSError, root: str, what: str, free_bytes: Callable[[], int]) -> DiskIOError:
    """The error to raise for `e`, met while doing `what` in the disk tier at
    `root`: DiskFull, saying how much is free, for ENOSPC/EDQUOT."""
    if e.errno in _FULL_ERRNOS:
        try:
            free = f"{free_bytes()} B free"
        except OSError:
            free = "free space unknown"
        return DiskFull(
            f"disk tier at {root} is full: {what} failed ({os.strerror(e.errno)}; "
            f"{e.strerror}); the filesystem has {free}. Nothing was stored; reads go on. "
            "Free space, lower the disk tier's capacity, or let eviction run", e.errno)
    return DiskIOError(f"disk tier at {root}: {what} failed: {e}", e.errno)
