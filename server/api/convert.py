"""Protobuf <-> ledger value conversion, kept out of the servicer's control flow."""
from __future__ import annotations

from typing import Any, Optional, Sequence

from kvkeeper.v1 import kvkeeper_pb2 as pb

from ..ids import CLUSTER, DISK, GPU, HOST, TierName
from ..ledger import LookupReport, NamespaceDescriptor, SlotStatus, TierStats

TIER_TO_PB = {GPU: pb.TIER_GPU, HOST: pb.TIER_HOST, DISK: pb.TIER_DISK,
              CLUSTER: pb.TIER_CLUSTER}
SLOT_TO_PB = {
    SlotStatus.RESERVED: pb.SLOT_RESERVED,
    SlotStatus.PRESENT: pb.SLOT_PRESENT,
    SlotStatus.IN_FLIGHT: pb.SLOT_IN_FLIGHT,
    SlotStatus.NOT_ADMITTED: pb.SLOT_NOT_ADMITTED,
}


def descriptor_from_pb(d: "pb.NamespaceDescriptor") -> NamespaceDescriptor:
    return NamespaceDescriptor(
        model_id=d.model_id, model_revision=d.model_revision, dtype=d.dtype,
        kv_layout=d.kv_layout, block_tokens=d.block_tokens, block_bytes=d.block_bytes,
        tp_rank=d.tp_rank, tp_size=d.tp_size or 1, cache_salt=d.cache_salt, lora_tag=d.lora_tag,
    )


def tier_to_pb(name: TierName) -> int:
    return TIER_TO_PB.get(name, pb.TIER_UNSPECIFIED)


def report_from_pb(r: "pb.LookupReport") -> LookupReport:
    return LookupReport(prompt_tokens=r.prompt_tokens, prompt_blocks=r.prompt_blocks,
                        local_blocks=r.local_blocks, loaded_blocks=r.loaded_blocks)


Extents = Sequence[tuple[int, int]]


def fill_slots(resp: "pb.ReserveSaveResponse", statuses: Sequence[int],
               extents: Sequence[Extents], columns: bool) -> None:
    """ReserveSave's answer: slot i has statuses[i] (a pb.SlotStatus) and
    extents[i] ((offset, length) pairs, none unless reserved over shm). As
    SlotColumns when the client asked for them (`columns`), else as a
    SaveSlot per key, as every daemon answers a client that does not ask."""
    if not columns:
        for status, ext in zip(statuses, extents):
            slot = resp.slots.add(status=status)
            for o, n in ext:
                slot.extents.add(offset=o, length=n)
        return
    _extent_columns(_slot_columns(resp, statuses), extents)


def block_runs(arena: Any, blocks: Sequence[Any]) -> Optional[tuple[list[Optional[int]], int]]:
    """Where each of a reservation's or lease's blocks (one namespace's; None:
    no block) lies in `arena` when each is one run of pages (Arena.run_offsets),
    and their size; None when none is a block or one is not a single run (then
    the caller asks Arena.extents block by block)."""
    ns = next((b.ns for b in blocks if b is not None), None)
    if ns is None:
        return None
    offsets = arena.run_offsets([None if b is None else b.pages for b in blocks],
                                ns.pages_per_block, ns.block_bytes)
    return None if offsets is None else (offsets, ns.block_bytes)


def fill_slot_runs(resp: "pb.ReserveSaveResponse", statuses: Sequence[int],
                   offsets: Sequence[Optional[int]], nbytes: int) -> None:
    """fill_slots' columns where each reserved block is one run of `nbytes`
    at offsets[i] (None: no extents), as Arena.run_offsets gives them."""
    _run_columns(_slot_columns(resp, statuses), offsets, nbytes)


def _slot_columns(resp: "pb.ReserveSaveResponse", statuses: Sequence[int]) -> Any:
    """resp's SlotColumns with the statuses in; the extents are the caller's."""
    c: Any = resp.columns
    c.SetInParent()   # present even with no keys: the client reads the columns
    c.status.extend(statuses)
    return c


def fill_refs(out: Any, keys: Sequence[bytes], sums: Sequence[tuple[int, int]],
              extents: Sequence[Extents]) -> None:
    """A BlockRef per block appended to `out` (a repeated BlockRef field):
    keys[i], sums[i] as (checksum_algo, checksum), extents[i]. Built in
    place with add(): about half the cost of building and copying sub-messages."""
    for k, (algo, value), ext in zip(keys, sums, extents):
        ref = out.add(key=k, checksum_algo=algo, checksum=value)
        for o, n in ext:
            ref.extents.add(offset=o, length=n)


def fill_block_columns(c: Any, keys: Sequence[bytes], sums: Sequence[tuple[int, int]],
                       extents: Sequence[Extents]) -> None:
    """The same refs as fill_refs', into a BlockColumns message `c`."""
    _block_columns(c, keys, sums)
    _extent_columns(c, extents)


def fill_block_runs(c: Any, keys: Sequence[bytes], sums: Sequence[tuple[int, int]],
                    offsets: Sequence[int], nbytes: int) -> None:
    """fill_block_columns where each block is one run of `nbytes` at offsets[i]."""
    _block_columns(c, keys, sums)
    _run_columns(c, offsets, nbytes)


def _block_columns(c: Any, keys: Sequence[bytes], sums: Sequence[tuple[int, int]]) -> None:
    """A BlockColumns' keys and checksums; the extents are the caller's."""
    c.SetInParent()
    c.key.extend(keys)
    c.checksum_algo.extend([a for a, _ in sums])
    c.checksum.extend([v for _, v in sums])


def _run_columns(c: Any, offsets: Sequence[Optional[int]], nbytes: int) -> None:
    runs = [o for o in offsets if o is not None]
    c.extent_count.extend([0 if o is None else 1 for o in offsets])
    c.offset.extend(runs)
    c.length.extend([nbytes] * len(runs))


def _extent_columns(c: Any, extents: Sequence[Extents]) -> None:
    c.extent_count.extend(map(len, extents))
    flat = [e for ext in extents for e in ext]
    c.offset.extend([o for o, _ in flat])
    c.length.extend([n for _, n in flat])


def tier_stats_to_pb(t: TierStats) -> pb.TierStats:
    return pb.TierStats(
        tier=tier_to_pb(t.name), capacity_bytes=t.capacity_bytes, used_bytes=t.used_bytes,
        pinned_bytes=t.pinned_bytes, evictable_bytes=t.evictable_bytes,
        capacity_pages=t.capacity_pages, used_pages=t.used_pages, blocks=t.blocks,
        pending_blocks=t.pending_blocks, evictions=sum(t.evictions.values()),
        hit_blocks=t.hit_blocks)
