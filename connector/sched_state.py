"""What the scheduler side keeps per request: its key chains, its lease, its
lookup in flight, and how far its blocks are known to be saved."""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Dict, List, Optional, Sequence, Set, Tuple

from .keys import KeyChain
from .lookup import Lease, Lookup

__all__ = ["LAST_TURN", "RequestState", "last_turn", "request_seed_inputs"]

# The key of a request's kv_transfer_params that says it is its
# conversation's last turn (a client that knows no request continues it).
LAST_TURN = "kvkeeper_last_turn"

log = logging.getLogger("kvkeeper.connector")


def request_seed_inputs(request: Any) -> Tuple[Optional[str], Optional[str], List[str]]:
    """(cache_salt, lora tag, multimodal identities) of a vLLM Request: what,
    besides the tokens and the namespace, changes a request's KV."""
    salt = getattr(request, "cache_salt", None)
    lora = getattr(request, "lora_request", None)
    tag = None
    if lora is not None:
        name = getattr(lora, "lora_name", None) or getattr(lora, "name", None)
        tag = str(name) if name else f"id:{getattr(lora, 'lora_int_id', '')}"
    mm: List[str] = []
    for f in getattr(request, "mm_features", None) or ():
        pos = getattr(f, "mm_position", None)
        off = getattr(pos, "offset", "")
        length = getattr(pos, "length", "")
        mm.append(f"{getattr(f, 'identifier', '')}@{off}+{length}")
    return salt, tag, mm


def last_turn(request: Any) -> bool:
    """Whether the request's kv_transfer_params say {"kvkeeper_last_turn": true}:
    nobody reads its prompt's blocks again soon. Its blocks are not saved and
    the daemon's copies of what it read are demoted (Release.last_turn). Any
    value but a JSON boolean is ignored, with a warning: a client's typo
    must not fail the request."""
    params = getattr(request, "kv_transfer_params", None)
    if not isinstance(params, dict) or LAST_TURN not in params:
        return False
    value = params[LAST_TURN]
    if not isinstance(value, bool):
        log.warning("kvkeeper: request %s: kv_transfer_params[%r] is %r, not true or false; "
                    "ignored", getattr(request, "request_id", "?"), LAST_TURN, value)
        return False
    return value


@dataclass
class RequestState:
    request: Any
    chains: List[KeyChain]     # per TP rank
    cacheable: bool
    lease: Optional[Lease] = None
    lookup: Optional[Lookup] = None      # in flight, its answer not used yet
    saved_blocks: Optional[int] = None   # leading blocks stored or planned; None: unknown yet
    hit_tokens: int = 0
    saved_total: int = 0
    loads: Set[int] = field(default_factory=set)   # load ids in flight
    hit_sources: Dict[str, int] = field(default_factory=dict)   # the last hit's tokens per tier
    last_turn: bool = field(init=False)   # its conversation's last turn (last_turn())

    def __post_init__(self) -> None:
        self.last_turn = last_turn(self.request)

    def keys(self, rank: int, start: int, end: int) -> Tuple[bytes, ...]:
        """TP rank `rank`'s keys of the request's blocks start..end-1."""
        return tuple(self.chains[rank].keys(self.request.all_token_ids, end)[start:end])

    def report(self, block_tokens: int, namespaces: Sequence[Dict[str, Any]],
               groups: int) -> Dict[str, Any]:
        """The kvkeeper report of kv_transfer_params (kvkeeper_report)."""
        out: Dict[str, Any] = {
            "hit_tokens": self.hit_tokens,
            "saved_blocks": self.saved_total,
            "block_tokens": block_tokens,
            "namespace": namespaces[0],
            "seed": self.chains[0].seed.hex(),
        }
        if self.hit_sources:   # the last hit's tokens per tier (hit_sources.py)
            out["hit_sources"] = dict(self.hit_sources)
        if groups > 1:   # every (TP rank, KV cache group) slot's, in slot order
            out["namespaces"] = list(namespaces)
            out["seeds"] = [c.seed.hex() for c in self.chains]
        return out
