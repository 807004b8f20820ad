"""Lookups and leases: match keys, pin the matched blocks, release them.

A leased match pins its blocks until `release` (or until the session goes),
so their bytes stay put while they are loaded; `narrow` gives back the part
of a lease the caller will not load.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, List, Mapping, Optional, Sequence

from kvkeeper.v1 import kvkeeper_pb2 as pb

from .checks import check_keys
from .errors import protocol_error
from .loads import Loads
from .session import Session
from .transport import Transport
from .wire import MatchReply, encode_match_request

__all__ = ["Leases", "MatchResult"]

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MatchResult:
    """`matched` leading keys are cached; `tiers[i]` is a kvkeeper_pb2.Tier value;
    `lease_id` is None unless a lease was asked for and something matched.
    `blocks`: with match(..., lease=True, blocks=True) on a client that maps
    the arena, the leased blocks' refs (arena extents and checksum), one per
    leased block in lease order, for `arena_views`; else empty. Each is a
    columns.Ref (a NamedTuple with a BlockRef's fields: key, extents of
    offset and length, checksum_algo, checksum), or a kvkeeper_pb2.BlockRef
    from a daemon that does not answer in columns."""

    matched: int
    tiers: List[int]
    lease_id: Optional[int]
    blocks: List[Any] = field(default_factory=list)   # columns.Ref or pb.BlockRef
    # The gpu tier: another engine's own KV cache holds the leading
    # gpu_matched keys (as its connector reported; not loadable from here).
    gpu_matched: int = 0
    gpu_engine: str = ""


class Leases:
    """The lookup and lease operations of one client (see AsyncClient)."""

    def __init__(self, session: Session, transport: Transport, loads: Loads) -> None:
        self._session = session
        self._transport = transport
        self._loads = loads

    async def match(self, keys: Sequence[bytes], lease: bool = False,
                    blocks: bool = False, report_use: bool = False) -> MatchResult:
        """See AsyncClient.match."""
        if blocks and not lease:
            raise ValueError("blocks=True needs lease=True: block extents are only "
                             "valid while a lease pins them")
        s = self._session
        kb = s.key_bytes  # what the keys were checked against, even if a rebind changes it
        keys = check_keys(keys, kb)
        if not keys:
            return MatchResult(0, [], None)
        limit = s.max_keys or len(keys)
        if lease:
            keys = keys[:limit]
        ask = blocks and self._transport.mapping is not None
        matched, tiers, lease_id = 0, [], None
        gpu_matched, gpu_engine = 0, ""
        refs: List[Any] = []
        for start in range(0, len(keys), limit):
            part = keys[start:start + limit]
            resp = await s.unary(
                "Match",
                lambda sid: encode_match_request(sid, part, kb, lease, ask, report_use),
                retry=not lease, rebind=True)
            if start == 0:
                gpu_matched, gpu_engine = resp.gpu_matched, resp.gpu_engine
            matched += resp.matched
            tiers.extend(resp.tiers)
            if lease and resp.lease_id:
                lease_id = resp.lease_id
                if ask:
                    refs = await self._leased_refs(resp)
            if resp.matched < len(part):
                break
        return MatchResult(matched, tiers, lease_id, refs, gpu_matched, gpu_engine)

    async def _leased_refs(self, resp: MatchReply) -> List[Any]:
        """The BlockRefs of the lease a Match(blocks=true) granted. On any
        failure the lease is released, since the caller never learns its id."""
        try:
            refs = list(resp.blocks)
            if not refs:
                # A daemon older than MatchRequest.blocks ignores it: Load as before.
                refs = list((await self._loads.block_refs(resp.lease_id)).blocks)
            if len(refs) != resp.matched:
                raise protocol_error(f"lease {resp.lease_id} of {resp.matched} blocks came "
                                      f"with {len(refs)} block refs")
            return refs
        except BaseException:
            try:
                await self.release(resp.lease_id)
            except Exception as e:  # the lease goes with the session at the latest
                log.debug("kvkeeper: releasing lease %d failed: %s", resp.lease_id, e)
            raise

    async def release(self, lease_id: int, discard: bool = False,
                      discard_indices: Sequence[int] = (),
                      report: Optional[Mapping[str, int]] = None,
                      last_turn: bool = False) -> None:
        """See AsyncClient.release."""
        def build(s: str) -> pb.ReleaseRequest:
            return pb.ReleaseRequest(session_id=s, lease_id=lease_id, discard=discard,
                                     discard_indices=list(discard_indices),
                                     report=None if report is None else pb.LookupReport(**report),
                                     last_turn=last_turn)

        await self._session.unary("Release", build, retry=True, rebind=False)

    async def narrow(self, lease_id: int, start: int, count: int) -> None:
        """See AsyncClient.narrow."""
        await self._session.unary("Release", lambda s: pb.ReleaseRequest(
            session_id=s, lease_id=lease_id, keep_start=start, keep_blocks=count),
            retry=True, rebind=False)
