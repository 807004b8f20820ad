"""Protobuf <-> ledger value conversion, kept out of the servicer's control flow."""
from __future__ import annotations

from typing import Any, Sequence

from kvkeeper.v1 import kvkeeper_pb2 as pb

from ..ids import CLUSTER, DISK, GPU, HOST, TierName
from ..ledger import LookupReport, NamespaceDescriptor, SlotStatus

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
    c: Any = resp.columns
    c.SetInParent()   # present even with no keys: the client reads the columns
    c.status.extend(statuses)
    _extent_columns(c, extents)


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
    c.SetInParent()
    c.key.extend(keys)
    c.checksum_algo.extend([a for a, _ in sums])
    c.checksum.extend([v for _, v in sums])
    _extent_columns(c, extents)


def _extent_columns(c: Any, extents: Sequence[Extents]) -> None:
    c.extent_count.extend(map(len, extents))
    flat = [e for ext in extents for e in ext]
    c.offset.extend([o for o, _ in flat])
    c.length.extend([n for _, n in flat])
