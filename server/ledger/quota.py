"""Per-namespace quotas on the host tier: pure functions, no state.

A quota caps the bytes one namespace's blocks take in the host tier, counted
as whole pages (what a block really occupies) and including blocks still being
written. Quotas are keyed by model id, so an operator can write them before
any namespace exists; every namespace of that model (each TP rank, dtype,
salt ...) gets the quota on its own. The key "*" covers every model not named.

The check is a hard cap at reserve time: a namespace at its quota gets
RESOURCE_EXHAUSTED until its blocks leave (evicted under global pressure,
discarded, or `kvkeeper evict --namespace`). Making room by evicting the
namespace's own oldest blocks would need a per-namespace eviction order,
which the tiers do not keep.
"""
from __future__ import annotations

from typing import Mapping, Optional

from ..errors import ResourceExhausted
from ..quoting import clip

ANY_MODEL = "*"


def quota_for(quotas: Mapping[str, int], model_id: str) -> Optional[int]:
    """The quota in bytes for a namespace of `model_id`, or None when it has none."""
    quota = quotas.get(model_id)
    return quotas.get(ANY_MODEL) if quota is None else quota


def check_quota(*, namespace: str, model_id: str, quota_bytes: int, used_bytes: int,
                needed_bytes: int, blocks: int) -> None:
    """ResourceExhausted naming the quota when `needed_bytes` more would exceed it."""
    if used_bytes + needed_bytes <= quota_bytes:
        return
    raise ResourceExhausted(
        f"namespace {namespace} (model {clip(model_id)}) is over its quota of {quota_bytes} B: it "
        f"holds {used_bytes} B and saving {blocks} blocks needs {needed_bytes} B more; skip the "
        "save, evict its blocks (kvkeeper evict --namespace) or raise the quota in the "
        "[quotas] table of auth.tokens_file")
