"""The one contract every tier backend offers the daemon, and its two adapters.

The ledger decides where a block lives; a backend only moves its bytes. So a
backend first turns (namespace, key, size[, the ledger's pages]) into an opaque
location with `locate` (pure: no I/O), then `write`, `read_into` and `discard`
act on that location. Moving a block between tiers is then
`dst.write(dst_loc, view)` or `src.read_into(src_loc, view)` with a view of
the other tier's bytes, whatever the two backends are.

What differs, and is stated rather than papered over:

* `tracks_presence`: the disk store knows whether a block is stored (the file
  is the truth), so reading a location that was never written or was
  discarded raises NotStored, and a damaged one CorruptBlock. The arena does
  not: its pages belong to the ledger, `discard` frees nothing (the ledger
  reuses the pages) and reading them returns whatever they hold. Presence in
  the arena is the ledger's business.
* `persistent`: disk blocks survive a daemon restart; arena blocks do not.

All methods are synchronous; the daemon calls them off the event loop. Calls
on different locations may run concurrently.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Protocol, TypeVar, runtime_checkable

from kvkeeper.client.arena_format import Extent, byte_view

from ..ledger.pages import Pages
from ..ledger.units import ceil_div
from .arena import Arena
from .disk import CorruptBlock, DiskStore, NotStored, TierError, check_ns_key

__all__ = ["ArenaBackend", "ArenaLoc", "BlockStore", "CorruptBlock", "DiskBackend", "DiskLoc",
           "NotStored", "TierError"]

L = TypeVar("L")


@runtime_checkable
class BlockStore(Protocol[L]):
    name: str               # the tier: "host", "disk"
    persistent: bool        # blocks survive a daemon restart
    tracks_presence: bool   # read of an unwritten/discarded loc raises NotStored

    def locate(self, ns: bytes, key: bytes, nbytes: int, pages: Pages | None = None) -> L:
        """Where block (ns, key) of nbytes > 0 lives; no I/O. ValueError if invalid."""
        ...

    def write(self, loc: L, data: Any) -> int:
        """Store exactly loc's nbytes from `data` (any C-contiguous buffer),
        replacing what was there. Returns the bytes the tier now uses for it."""
        ...

    def read_into(self, loc: L, out: Any) -> None:
        """Copy the block into `out`, a writable buffer of exactly its size
        (ValueError otherwise, before any I/O)."""
        ...

    def discard(self, loc: L) -> int:
        """Drop the block; returns the bytes this backend freed (0 if none)."""
        ...


def _check_size(what: str, got: int, nbytes: int) -> None:
    if got != nbytes:
        raise ValueError(f"{what} holds {got} bytes, the block {nbytes}")


# ---------------------------------------------------------------- arena

class ArenaLoc(NamedTuple):
    extents: tuple[Extent, ...]
    nbytes: int


class ArenaBackend:
    """The host shared-memory arena. Locations are the extents of the pages
    the ledger allocated; the daemon's shm clients use the same extents."""

    name = "host"
    persistent = False
    tracks_presence = False

    def __init__(self, arena: Arena) -> None:
        self.arena = arena

    def locate(self, ns: bytes, key: bytes, nbytes: int, pages: Pages | None = None) -> ArenaLoc:
        check_ns_key(ns, key)
        if pages is None:
            raise ValueError("an arena location needs the pages the ledger allocated")
        if nbytes <= 0:
            raise ValueError(f"a block has at least one byte, got nbytes={nbytes}")
        n_pages = ceil_div(nbytes, self.arena.page_bytes)
        return ArenaLoc(tuple(self.arena.extents(pages, n_pages, nbytes)), nbytes)

    def write(self, loc: ArenaLoc, data: Any) -> int:
        src = byte_view(data)
        _check_size("data", src.nbytes, loc.nbytes)
        self.arena.write(loc.extents, src)
        return loc.nbytes

    def read_into(self, loc: ArenaLoc, out: Any) -> None:
        dst = byte_view(out, writable=True)
        _check_size("out", dst.nbytes, loc.nbytes)
        self.arena.read_into(loc.extents, dst)

    def discard(self, loc: ArenaLoc) -> int:
        return 0  # the pages are the ledger's to free and reuse


# ---------------------------------------------------------------- disk

class DiskLoc(NamedTuple):
    ns: bytes
    key: bytes
    nbytes: int


class DiskBackend:
    """The disk store: one file per block, found by (namespace, key)."""

    name = "disk"
    persistent = True
    tracks_presence = True

    def __init__(self, store: DiskStore) -> None:
        self.store = store

    def locate(self, ns: bytes, key: bytes, nbytes: int, pages: Pages | None = None) -> DiskLoc:
        ns, key = check_ns_key(ns, key)
        if pages is not None:
            raise ValueError("disk locations take no pages")
        if nbytes <= 0:
            raise ValueError(f"a block has at least one byte, got nbytes={nbytes}")
        return DiskLoc(ns, key, nbytes)

    def write(self, loc: DiskLoc, data: Any) -> int:
        src = byte_view(data)
        _check_size("data", src.nbytes, loc.nbytes)
        return self.store.write(loc.ns, loc.key, src)

    def read_into(self, loc: DiskLoc, out: Any) -> None:
        dst = byte_view(out, writable=True)
        _check_size("out", dst.nbytes, loc.nbytes)
        self.store.read_into(loc.ns, loc.key, dst)

    def discard(self, loc: DiskLoc) -> int:
        return self.store.delete(loc.ns, loc.key)
