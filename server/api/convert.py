"""Protobuf <-> ledger value conversion, kept out of the servicer's control flow."""
from __future__ import annotations

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
