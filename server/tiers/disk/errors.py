"""What a disk-tier operation raises, split by what went wrong.

NotStored and CorruptBlock are misses to the caller (a corrupt block is never
served as data); DiskIOError is the filesystem failing, DiskFull the one such
failure an operator fixes by freeing space.
"""
from __future__ import annotations

from ...errors import KVKeeperError


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
