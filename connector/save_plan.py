"""Save plans: a SaveSpec for every full block a step computes that is not
known to be in the daemon yet (prefill chunks and blocks filled by decoding;
loaded blocks are there already), except a conversation's last turn's; one
computed over a load still unconfirmed names it (after_loads)."""
from __future__ import annotations

import logging
from typing import Any, Callable, Mapping, Optional, Sequence

from .metadata import KVKeeperConnectorMetadata, SaveSpec
from .sched_state import RequestState

__all__ = ["plan_saves"]

log = logging.getLogger("kvkeeper.connector")


def plan_saves(so: Any, reqs: Mapping[str, RequestState], ranks: int, bs: int,
               block_ids_of: Callable[[str], Optional[Sequence[Any]]],
               meta: KVKeeperConnectorMetadata) -> None:
    """Append the saves of scheduler output `so` to meta.saves and advance
    each request's saved_blocks past them."""
    spec_tokens = getattr(so, "scheduled_spec_decode_tokens", None) or {}
    for req_id, scheduled in so.num_scheduled_tokens.items():
        st = reqs.get(req_id)
        if st is None or not st.cacheable or st.last_turn:   # nobody reads a last turn again
            continue
        req = st.request
        before = req.num_computed_tokens   # not yet advanced by this step
        if st.saved_blocks is None:
            st.saved_blocks = before // bs
        # Draft tokens may be rejected: their KV is not final.
        after = before + scheduled - len(spec_tokens.get(req_id, ()))
        full = min(after, req.num_tokens) // bs
        if full <= st.saved_blocks:
            continue
        got = block_ids_of(req_id)
        # One list of block ids, or one per KV cache group (the hybrid allocator).
        grouped = bool(got) and isinstance(got[0], (list, tuple))
        ids = got[0] if grouped else got
        if ids is None or len(ids) < full:
            log.debug("kvkeeper: %s holds %s blocks, %d are full; not saving this step",
                      req_id, None if ids is None else len(ids), full)
            continue
        start = st.saved_blocks
        keys = tuple(st.keys(r, start, full) for r in range(ranks))
        # The key before the first, so the daemon files a save that continues
        # the request's chain (a later prefill chunk, decode blocks) under it.
        parents = tuple(st.keys(r, start - 1, start)[0] if start else b"" for r in range(ranks))
        groups = tuple(tuple(g[start:full]) for g in got) if grouped else ()
        # A load of this request in flight: what this step computes attends to
        # the loaded blocks, so its save waits for their outcome (metadata.py).
        meta.saves.append(SaveSpec(req_id=req_id, keys=keys, block_ids=tuple(ids[start:full]),
                                   parents=parents, group_block_ids=groups,
                                   after_loads=tuple(sorted(st.loads))))
        st.saved_blocks = full
        st.saved_total += full - start
