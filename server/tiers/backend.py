"""The one contract every tier offers for stored bytes, and the host arena's implementation.

The ledger decides where a block lives and keeps every tier's book; a
backend only holds bytes. It first turns (namespace, key, size[, the
ledger's pages]) into an opaque location with `locate` (pure: no I/O); then

    write(loc, data)      put: store exactly the block's bytes, from one buffer or
                          a list of them (its pieces in order: a gathered write)
    read_into(loc, out)   get: copy them into the caller's buffer, or its list of
                          buffers (the block's pieces in order: a scatter read)
    contains(loc)         whether the medium holds the block
    discard(loc)          delete it
    view(loc)             a zero-copy view, where the bytes sit in one piece of memory
    views(loc)            zero-copy views of its pieces, where they sit in memory

and says what it can hold (`capacity_bytes`, `used_bytes()`) and how clients
reach its bytes (`reach`): same-host extents of a shared mapping, bytes
streamed through the daemon, or files. Moving a block between tiers is then
`copy_block(src, src_loc, dst, dst_loc)`, whatever the two backends are: the
tier stack (stack.py) does it for promotions and flushes. Each tier's module
holds its backend (the disk's is disk_tier.DiskBackend); every backend passes
tests/server/tiers/test_backend_contract.py.

What differs, and is stated rather than papered over:

* `tracks_presence`: the disk store knows whether a block is stored (the file
  is the truth), so reading a location that was never written or was
  discarded raises NotStored, and a damaged one CorruptBlock. The arena does
  not: its pages belong to the ledger, `discard` frees nothing (the ledger
  reuses the pages), reading them returns whatever they hold, `contains`
  answers None (ask the ledger) and `used_bytes()` is the ledger's count.
* `persistent`: disk blocks survive a daemon restart; arena blocks do not.

All methods are synchronous; the daemon calls the ones doing I/O off the
event loop. Calls on different locations may run concurrently.
"""
from __future__ import annotations

from typing import Any, Callable, NamedTuple, Optional, Protocol, TypeVar, runtime_checkable

from kvkeeper.client.arena_format import Extent, byte_view

from ..ledger.pages import Pages
from ..ledger.units import ceil_div
from .arena import Arena
from .disk import CorruptBlock, NotStored, TierError, check_ns_key

__all__ = ["ArenaBackend", "ArenaLoc", "BlockStore", "Checksum", "CorruptBlock", "NotStored", "Reach",
           "TierError", "check_size", "copy_block", "copy_pieces", "in_views", "out_views"]

# A block's (ChecksumAlgo value, checksum) as its writer committed it.
Checksum = tuple[int, int]

L = TypeVar("L")


class Reach:
    """How a client gets a tier's bytes."""

    EXTENTS = "extents"   # it maps the tier's file and copies (offset, length) pieces itself
    STREAM = "stream"     # the daemon streams them (LoadStream / WriteBlocks)
    FILES = "files"       # one file per block, on a medium clients may share


@runtime_checkable
class BlockStore(Protocol[L]):
    name: str               # the tier: "host", "disk"
    persistent: bool        # blocks survive a daemon restart
    tracks_presence: bool   # read of an unwritten/discarded loc raises NotStored
    reach: str              # a Reach value
    capacity_bytes: int     # what the medium may hold

    def used_bytes(self) -> int:
        """Bytes the tier's blocks take on the medium (no I/O)."""
        ...

    def locate(self, ns: bytes, key: bytes, nbytes: int, pages: Pages | None = None) -> L:
        """Where block (ns, key) of nbytes > 0 lives; no I/O. ValueError if invalid."""
        ...

    def write(self, loc: L, data: Any, checksum: Optional[Checksum] = None) -> int:
        """Store exactly loc's nbytes from `data` (any C-contiguous buffer),
        replacing what was there. Returns the bytes the tier now uses for it.
        checksum: the block's (algorithm, value) as its writer committed it; a
        tier that keeps checksums with its bytes (the disk) stores it, one
        whose checksums the ledger keeps (the arena) ignores it."""
        ...

    def read_into(self, loc: L, out: Any) -> Optional[Checksum]:
        """Copy the block into `out`, a writable buffer of exactly its size,
        or a list of writable buffers that together hold exactly its size,
        filled in order (ValueError otherwise, before any I/O). Returns the
        checksum the tier kept with the block (checked against it where the
        tier checks), None where it keeps none."""
        ...

    def discard(self, loc: L) -> int:
        """Drop the block; returns the bytes this backend freed (0 if none)."""
        ...

    def contains(self, loc: L) -> Optional[bool]:
        """Whether the medium holds the block; None where presence is the ledger's."""
        ...

    def view(self, loc: L) -> Optional[memoryview]:
        """A writable zero-copy view of the block's bytes, or None where they
        are not one piece of memory (valid while the location is the block's)."""
        ...

    def views(self, loc: L) -> Optional[list[memoryview]]:
        """Writable zero-copy views of the block's pieces, in order (one, where
        `view` gives one), or None where its bytes are not in memory."""
        ...


def copy_block(src: BlockStore[Any], src_loc: Any, dst: BlockStore[Any], dst_loc: Any,
               nbytes: int, checksum: Optional[Checksum] = None) -> Optional[Checksum]:
    """Move one block's bytes from `src` to `dst` in one copy where either side
    offers a view, through one bounce buffer otherwise. `checksum` goes to
    `dst` with the bytes; returns the checksum `src`'s read_into gave (None
    when `src` was read through its view: a tier of plain memory, whose
    checksums the ledger keeps)."""
    into: Any = dst.view(dst_loc)
    if into is None:
        # A block in several pieces of memory (an arena block whose pages are
        # not one run): read straight into them, no bounce buffer.
        into = dst.views(dst_loc)
    if into is not None:
        return src.read_into(src_loc, into)
    kept = None
    out = src.view(src_loc)
    if out is None:
        # Likewise from a fragmented arena block: a gathered write of its pages.
        out = src.views(src_loc)
    if out is None:
        out = memoryview(bytearray(nbytes))
        kept = src.read_into(src_loc, out)
    dst.write(dst_loc, out, checksum if checksum is not None else kept)
    return kept


def check_size(what: str, got: int, nbytes: int) -> None:
    """ValueError unless a caller's buffer holds exactly the block's bytes."""
    if got != nbytes:
        raise ValueError(f"{what} holds {got} bytes, the block {nbytes}")


def out_views(out: Any, nbytes: int) -> memoryview | list[memoryview]:
    """read_into's `out` as a flat writable view, or a list of them (a scatter
    read), holding exactly `nbytes` in all; ValueError otherwise."""
    return _views("out", out, nbytes, True)


def in_views(data: Any, nbytes: int) -> memoryview | list[memoryview]:
    """write's `data` as a flat view, or a list of them (a gathered write),
    holding exactly `nbytes` in all; ValueError otherwise."""
    return _views("data", data, nbytes, False)


def _views(what: str, bufs: Any, nbytes: int, writable: bool) -> memoryview | list[memoryview]:
    if isinstance(bufs, list):
        views = [byte_view(b, writable=writable) for b in bufs]
        check_size(what, sum(v.nbytes for v in views), nbytes)
        return views
    one = byte_view(bufs, writable=writable)
    check_size(what, one.nbytes, nbytes)
    return one


def copy_pieces(srcs: list[memoryview], dsts: list[memoryview]) -> None:
    """The bytes of `srcs`, in order, copied into `dsts`, in order (equal totals)."""
    i = j = si = dj = 0
    while i < len(srcs) and j < len(dsts):
        s, d = srcs[i], dsts[j]
        n = min(s.nbytes - si, d.nbytes - dj)
        d[dj:dj + n] = s[si:si + n]
        si += n
        dj += n
        if si == s.nbytes:
            i, si = i + 1, 0
        if dj == d.nbytes:
            j, dj = j + 1, 0


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
    reach = Reach.EXTENTS

    def __init__(self, arena: Arena, used_bytes: Optional[Callable[[], int]] = None) -> None:
        """`used_bytes`: the ledger's count of the arena's bytes in use (its
        pages are the ledger's); without one, the arena reports none used."""
        self.arena = arena
        self.capacity_bytes = arena.page_count * arena.page_bytes
        self._used = used_bytes

    def used_bytes(self) -> int:
        return self._used() if self._used is not None else 0

    def locate(self, ns: bytes, key: bytes, nbytes: int, pages: Pages | None = None) -> ArenaLoc:
        check_ns_key(ns, key)
        if pages is None:
            raise ValueError("an arena location needs the pages the ledger allocated")
        if nbytes <= 0:
            raise ValueError(f"a block has at least one byte, got nbytes={nbytes}")
        n_pages = ceil_div(nbytes, self.arena.page_bytes)
        return ArenaLoc(tuple(self.arena.extents(pages, n_pages, nbytes)), nbytes)

    def write(self, loc: ArenaLoc, data: Any, checksum: Optional[Checksum] = None) -> int:
        src = in_views(data, loc.nbytes)
        if isinstance(src, list):
            copy_pieces(src, self.arena.gather(loc.extents))
        else:
            self.arena.write(loc.extents, src)
        return loc.nbytes

    def read_into(self, loc: ArenaLoc, out: Any) -> Optional[Checksum]:
        dst = out_views(out, loc.nbytes)
        if isinstance(dst, list):
            copy_pieces(self.arena.gather(loc.extents), dst)
        else:
            self.arena.read_into(loc.extents, dst)
        return None  # the ledger keeps the arena's checksums

    def discard(self, loc: ArenaLoc) -> int:
        return 0  # the pages are the ledger's to free and reuse

    def contains(self, loc: ArenaLoc) -> Optional[bool]:
        return None  # the ledger's book says which pages hold a block

    def view(self, loc: ArenaLoc) -> Optional[memoryview]:
        if len(loc.extents) != 1:
            return None
        return self.arena.view(*loc.extents[0])

    def views(self, loc: ArenaLoc) -> Optional[list[memoryview]]:
        return self.arena.gather(loc.extents)
