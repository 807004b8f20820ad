"""The admin servicer (kvkeeper.v1.KVKeeperAdmin): a thin adapter for operators.

Reads the ledger's books through the tier stack, and calls what already
exists for each action: Ledger.reclaim_unpinned (Evict), TierStack.drain
(Drain), a tier's verify_all in a worker thread (Verify). Errors become status codes
in api.status only. Every action that changes something is logged once,
with namespace ids and counts (never keys).
"""
from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections import defaultdict
from typing import Any, AsyncIterator, Optional

from kvkeeper.v1 import admin_pb2 as apb
from kvkeeper.v1 import admin_pb2_grpc as apb_grpc
from kvkeeper.v1 import kvkeeper_pb2 as pb

from ..errors import FailedPrecondition, InvalidArgument, NotFound
from ..ids import NamespaceId
from ..ledger import Holding, Ledger
from ..ledger.quota import quota_for
from ..tiers.stack import TierStack
from .convert import tier_to_pb
from .handler import rpc, rpc_stream
from .sibling import Sibling, namespace_id

log = logging.getLogger("kvkeeper.admin")

# Verify reports progress about this many times, whatever the number of blocks.
PROGRESS_STEPS = 100
SALT_SET = "(set)"


def _add_holdings(info: Any, holdings: list[Holding]) -> None:
    for h in holdings:
        info.tiers.add(tier=tier_to_pb(h.tier), blocks=h.blocks, bytes=h.bytes)


class _VerifyCancelled(Exception):
    """Raised inside verify_all's thread once the caller has gone away."""


class AdminServicer(Sibling, apb_grpc.KVKeeperAdminServicer):
    def __init__(self, ledger: Ledger, data: Any, stack: TierStack) -> None:
        """`data` is the KVKeeperServicer: its `serving` and `accepting_saves`
        flags, and its metrics, where admin calls are counted too."""
        self.ledger = ledger
        self.data = data
        self.stack = stack
        self._verifying = False

    def _namespace_id(self, raw: bytes) -> NamespaceId:
        return namespace_id(raw)

    # ------------------------------------------------------------ reading
    @rpc
    async def ListNamespaces(self, request: apb.ListNamespacesRequest,
                             context: Any) -> apb.ListNamespacesResponse:
        L = self.ledger
        sessions: dict[bytes, int] = defaultdict(int)
        for s in L.sessions.values():
            sessions[s.ns.id] += 1
        held = self.stack.holdings()
        resp = apb.ListNamespacesResponse()
        for ns in sorted(L.namespaces.values(), key=lambda n: (n.descriptor.model_id, n.id)):
            d = ns.descriptor
            info = resp.namespaces.add(namespace_id=ns.id, registered=True,
                                       sessions=sessions.get(ns.id, 0))
            info.descriptor.CopyFrom(pb.NamespaceDescriptor(
                model_id=d.model_id, model_revision=d.model_revision, dtype=d.dtype,
                kv_layout=d.kv_layout, block_tokens=d.block_tokens, block_bytes=d.block_bytes,
                tp_rank=d.tp_rank, tp_size=d.tp_size, lora_tag=d.lora_tag,
                # A salt keeps one tenant's prefixes from another's: say only that it is set.
                cache_salt=SALT_SET if d.cache_salt else ""))
            _add_holdings(info, held.pop(ns.id))
            quota = quota_for(L.quotas, d.model_id)
            if quota is not None:
                info.quota_bytes = quota
        # Namespaces lower tiers hold that no session has named since start-up.
        for ns_id in sorted(held):
            _add_holdings(resp.namespaces.add(namespace_id=ns_id, registered=False), held[ns_id])
        return resp

    @rpc
    async def InspectBlock(self, request: apb.InspectBlockRequest,
                           context: Any) -> apb.InspectBlockResponse:
        ns_id = self._namespace_id(request.namespace_id)
        kb = self.ledger.config.key_bytes
        if len(request.key) != kb:
            raise InvalidArgument(f"a key has {kb} bytes ({2 * kb} hex digits), got {len(request.key)}")
        key = bytes(request.key)
        resp = apb.InspectBlockResponse()
        for c in self.stack.copies(ns_id, key):
            resp.copies.add(tier=tier_to_pb(c.tier), state=c.state, refs=c.refs, hits=c.hits,
                            idle_seconds=c.idle_seconds, bytes=c.bytes)
        b = self.ledger.block(ns_id, key)
        if b is not None and b.checksum is not None:
            resp.checksum_algo, resp.checksum = b.checksum
        if not resp.copies:
            raise NotFound(f"no tier holds that block of namespace {ns_id.hex()}; "
                           "`kvkeeper ls` lists the namespaces")
        return resp

    # ------------------------------------------------------------ actions
    @rpc
    async def Evict(self, request: apb.EvictRequest, context: Any) -> apb.EvictResponse:
        target = request.WhichOneof("target")
        if target is None or (target == "all" and not request.all):
            raise InvalidArgument("name what to evict: namespace_id, or all = true")
        L = self.ledger
        ns_id: Optional[NamespaceId] = None
        if target == "namespace_id":
            ns_id = self._namespace_id(request.namespace_id)
            if ns_id not in L.namespaces:
                raise NotFound(f"unknown namespace {ns_id.hex()}; `kvkeeper ls` lists them")
        evicted = L.reclaim_unpinned(ns_id)
        scope = [L.namespaces[ns_id]] if ns_id is not None else L.namespaces.values()
        remaining = sum(len(ns.blocks) for ns in scope)
        log.info("admin evict %s: %d blocks evicted, %d referenced or pending stay",
                 ns_id.hex() if ns_id is not None else "all namespaces", evicted, remaining,
                 extra={"event": "admin_evict", "namespace": ns_id.hex() if ns_id else "*",
                        "evicted": evicted, "remaining": remaining})
        return apb.EvictResponse(evicted=evicted, remaining=remaining)

    @rpc
    async def Drain(self, request: apb.DrainRequest, context: Any) -> apb.DrainResponse:
        t0 = time.perf_counter()
        if self.data.accepting_saves:
            self.data.accepting_saves = False
            log.info("admin drain: saves are refused from now on", extra={"event": "admin_drain"})
        await self.stack.drain()
        open_reservations = self.ledger.open_reservations()
        seconds = time.perf_counter() - t0
        log.info("admin drain: write-back flushed in %.3fs; %d reservations still open",
                 seconds, open_reservations,
                 extra={"event": "admin_drained", "open_reservations": open_reservations})
        return apb.DrainResponse(disk_tier=bool(self.stack.lower),
                                 open_reservations=open_reservations, seconds=seconds)

    @rpc_stream
    async def Verify(self, request: apb.VerifyRequest,
                     context: Any) -> AsyncIterator[apb.VerifyProgress]:
        tier = self.stack.verifiable()
        if tier is None:
            raise FailedPrecondition("there is no disk tier (disk_tier.path is empty); "
                                     "nothing to verify")
        if self._verifying:
            raise FailedPrecondition("a verify is already running; wait for it to finish")
        self._verifying = True
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue[Optional[tuple[int, int]]] = asyncio.Queue()
        gone = threading.Event()
        quarantined_before = tier.quarantined

        def progress(done: int, total: int) -> None:  # runs in the worker thread
            if gone.is_set():
                raise _VerifyCancelled()
            if done == total or done % max(1, total // PROGRESS_STEPS) == 0:
                loop.call_soon_threadsafe(queue.put_nowait, (done, total))

        log.info("admin verify: started", extra={"event": "admin_verify"})
        work = loop.run_in_executor(None, tier.verify_all, progress)
        work.add_done_callback(lambda _: queue.put_nowait(None))
        try:
            while (item := await queue.get()) is not None:
                yield apb.VerifyProgress(processed=item[0], total=item[1])
            report = await work
        finally:
            # A caller that went away stops the thread at its next block.
            gone.set()
            self._verifying = False
            if not work.done():
                work.add_done_callback(lambda f: f.cancelled() or f.exception())
        quarantined = tier.quarantined - quarantined_before
        total = report.checked + report.corrupt + report.missing
        level = logging.WARNING if report.corrupt else logging.INFO
        log.log(level, "admin verify: %d blocks checked, %d bad, %d missing, %d quarantined "
                "in %.1fs", report.checked, report.corrupt, report.missing, quarantined,
                report.seconds, extra={"event": "admin_verified", "checked": report.checked,
                                       "bad": report.corrupt, "quarantined": quarantined})
        yield apb.VerifyProgress(processed=total, total=total, done=True, checked=report.checked,
                                 bad=report.corrupt, missing=report.missing,
                                 quarantined=quarantined, bytes=report.bytes,
                                 seconds=report.seconds)
