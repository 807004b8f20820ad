"""Answers in columns: ReserveSave's slots, Load's and Match's block refs as
packed arrays (SlotColumns, BlockColumns) instead of a message per block.

Building and reading a SaveSlot or BlockRef costs ~1-2.5 us a block on each
side in Python; a column is one packed field, built and read in C. The
client asks for columns (ReserveSaveRequest.columns, LoadRequest.columns,
MatchRequest.columns); a daemon that does not know the fields answers with
the messages, and everything here reads both.
"""
from __future__ import annotations

from typing import Any, List, NamedTuple, Tuple

from .arena_format import Extent
from .copies import Stored, extents_of, stored

__all__ = ["Ref", "RefExtent", "refs_of", "slots_of", "stored_of"]


class RefExtent(NamedTuple):
    """An Extent message's fields (offset, length), as a tuple."""

    offset: int
    length: int


class Ref(NamedTuple):
    """A BlockRef read out of BlockColumns: the same fields, read the same way
    (ref.extents[i].offset, ref.checksum_algo, ...), and a plain tuple (it
    pickles as one, into the connector's metadata)."""

    key: bytes
    extents: Tuple[RefExtent, ...]
    checksum_algo: int
    checksum: int


def slots_of(resp: Any) -> List[Tuple[int, List[Extent]]]:
    """(status, extents) of each slot of a ReserveSaveResponse: from its
    SlotColumns when the daemon answered with them, else from its SaveSlots.
    ValueError when the columns do not add up."""
    if not resp.HasField("columns"):
        return [(s.status, extents_of(s.extents)) for s in resp.slots]
    c = resp.columns
    status = list(c.status)
    return list(zip(status, _column_extents(c, len(status))))


def stored_of(resp: Any) -> List[Stored]:
    """copies.stored of a LoadResponse's refs: from its BlockColumns when the
    daemon answered with them, else from its BlockRefs. ValueError when the
    columns do not add up."""
    if not resp.HasField("columns"):
        return stored(resp.blocks)
    c = resp.columns
    algos, sums = _sums(c)
    return list(zip(algos, sums, _column_extents(c, len(algos))))


def refs_of(c: Any) -> List[Ref]:
    """The refs of a BlockColumns message (MatchResponse.columns), in order.
    ValueError when the columns do not add up."""
    algos, sums = _sums(c)
    keys = list(c.key)
    if len(keys) != len(algos):
        raise ValueError(f"block columns do not add up: {len(keys)} keys, {len(algos)} "
                         "checksum algorithms")
    exts = _column_extents(c, len(keys))
    # tuple.__new__ straight: a NamedTuple's own __new__ is a Python call
    # (~0.3 us), and this builds two per block on the connector's lookup.
    new = tuple.__new__
    return [new(Ref, (k, tuple([new(RefExtent, p) for p in e]), a, v))
            for k, e, a, v in zip(keys, exts, algos, sums)]


def _sums(c: Any) -> Tuple[List[int], List[int]]:
    algos, sums = list(c.checksum_algo), list(c.checksum)
    if len(sums) != len(algos):
        raise ValueError(f"block columns do not add up: {len(algos)} checksum algorithms, "
                         f"{len(sums)} checksums")
    return algos, sums


def _column_extents(c: Any, n: int) -> List[List[Extent]]:
    """The extents of each of n slots or refs, from a columns message's
    extent_count, offset and length (SlotColumns, BlockColumns)."""
    counts = list(c.extent_count)
    pairs = list(zip(c.offset, c.length))
    if len(counts) != n or len(c.offset) != len(c.length) or sum(counts) != len(pairs):
        raise ValueError(f"columns do not add up: {n} entries, {len(counts)} extent counts "
                         f"adding up to {sum(counts)}, {len(c.offset)} offsets, "
                         f"{len(c.length)} lengths")
    if counts.count(1) == n:     # the usual: one extent per block
        return [[p] for p in pairs]
    out, at = [], 0
    for k in counts:
        out.append(pairs[at:at + k])
        at += k
    return out
