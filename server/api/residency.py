"""The residency servicer (kvkeeper.v1.KVKeeperResidency): a thin adapter over
the ledger's gpu tier (ledger/residency.py, ledger/routing.py) and its event
log (ledger/events.py).

ReportResidency and Locate are one synchronous ledger call each. WatchEvents
is held open: each open call keeps a cursor (the last sequence number it
sent) and an asyncio.Event that the event log's on_append sets, and sends
what the log holds after its cursor, a gap first when the log dropped some.
Errors become status codes in api.status only.
"""
from __future__ import annotations

import asyncio
import time
from typing import Any, AsyncIterator, Callable, Iterator, Optional, Sequence

from kvkeeper.v1 import residency_pb2 as rpb
from kvkeeper.v1 import residency_pb2_grpc as rpb_grpc

from ..errors import InvalidArgument, PermissionDenied, Unavailable
from ..ids import NamespaceId, SessionId
from ..ledger import Ledger
from ..ledger.events import CLEARED, REMOVED, STORED, ResidencyEvent
from ..ledger.residency import Change
from ..ledger.routing import Placement
from ..security import identity
from .convert import descriptor_from_pb, tier_to_pb
from .handler import rpc, rpc_held
from .sibling import Sibling, namespace_id

KIND_FROM_PB = {rpb.RESIDENCY_STORED: STORED, rpb.RESIDENCY_REMOVED: REMOVED,
                rpb.RESIDENCY_CLEARED: CLEARED}
KIND_TO_PB = {v: k for k, v in KIND_FROM_PB.items()}
# Keys per WatchEvents message at most (about 150 KiB): a long replay goes
# in several messages, well under any message limit.
MESSAGE_KEYS = 4096
# Namespace digests kept for Locate and WatchEvents requests naming a descriptor.
DIGESTS = 1024


class ResidencyServicer(Sibling, rpb_grpc.KVKeeperResidencyServicer):
    def __init__(self, ledger: Ledger, data: Any,
                 clock: Callable[[], float] = time.monotonic) -> None:
        """`data` is the KVKeeperServicer: its `serving` flag, its metrics
        (where these calls are counted too) and its namespace authorization."""
        self.ledger = ledger
        self.data = data
        self.clock = clock
        self.log = ledger.residency.log
        self._wakes: set[asyncio.Event] = set()
        self._stopping = False
        self.log.on_append = self._appended
        # Serialized descriptor -> (model id, namespace id), bounded (DIGESTS).
        self._digests: dict[bytes, tuple[str, NamespaceId]] = {}

    def __len__(self) -> int:
        """Open WatchEvents calls."""
        return len(self._wakes)

    def _appended(self) -> None:
        for w in self._wakes:
            w.set()

    def end_all(self) -> None:
        """The daemon stops: every open WatchEvents call ends UNAVAILABLE now."""
        self._stopping = True
        self._appended()

    # ------------------------------------------------------------ namespaces
    def _authorize(self, context: Any, model_id: str) -> None:
        check = getattr(self.data, "authorize_namespace", None)
        if check is not None:
            check(context, model_id)

    def _namespace(self, request: Any, context: Any, required: bool) -> Optional[NamespaceId]:
        which = request.WhichOneof("namespace")
        if which == "descriptor":
            # A router names the same namespace call after call: its digest
            # (canonical JSON, sha256) is worth keeping.
            raw = request.descriptor.SerializeToString()
            known = self._digests.get(raw)
            if known is None:
                d = descriptor_from_pb(request.descriptor)
                d.validate()
                if len(self._digests) >= DIGESTS:
                    self._digests.clear()
                known = self._digests[raw] = (d.model_id, d.digest())
            self._authorize(context, known[0])
            return known[1]
        if which == "namespace_id":
            ns_id = namespace_id(request.namespace_id)
            ns = self.ledger.namespaces.get(ns_id)
            # A token limited to some models may name only a namespace of theirs;
            # the refusal is the same whether the id exists or not, and names no
            # model: an id is no way to learn another tenant's model or namespaces.
            see = getattr(self.data, "may_see_model", None)
            if see is not None and not see(context, "*") and \
                    (ns is None or not see(context, ns.descriptor.model_id)):
                raise PermissionDenied("this token covers no namespace with that namespace_id; "
                                       "name one of its own models' namespaces")
            return ns_id
        if required:
            raise InvalidArgument("name the namespace: its descriptor or its namespace_id")
        self._authorize(context, "*")   # every namespace: only a token that covers all
        return None

    # ------------------------------------------------------------ calls
    @rpc
    async def ReportResidency(self, request: rpb.ReportResidencyRequest,
                              context: Any) -> rpb.ReportResidencyResponse:
        changes = []
        for i, c in enumerate(request.changes):
            kind = KIND_FROM_PB.get(c.kind)
            if kind is None:
                raise InvalidArgument(f"change {i}: kind {c.kind} is not STORED, REMOVED or "
                                      "CLEARED")
            changes.append(Change(kind, c.keys, c.block_ids))
        r = self.ledger.report_residency(
            SessionId(request.session_id), changes, self.clock(),
            capacity_blocks=request.capacity_blocks, report_seq=request.report_seq,
            owner=identity.of(context))
        return rpb.ReportResidencyResponse(engine=r.engine, resident_blocks=r.resident_blocks,
                                           applied=r.applied)

    @rpc
    async def Locate(self, request: rpb.LocateRequest, context: Any) -> rpb.LocateResponse:
        ns = self._namespace(request, context, required=True)
        assert ns is not None
        return placement_to_pb(self.ledger.locate_chain(ns, request.keys))

    @rpc_held
    async def WatchEvents(self, request: rpb.WatchEventsRequest,
                          context: Any) -> AsyncIterator[rpb.WatchEventsResponse]:
        ns = self._namespace(request, context, required=False)
        known = self.ledger.namespaces.get(ns) if ns is not None else None
        model = (request.descriptor.model_id if request.WhichOneof("namespace") == "descriptor"
                 else known.descriptor.model_id if known is not None else "*")
        log = self.log
        restarted = request.resume and request.epoch != log.epoch
        cursor = request.after_seq if request.resume and not restarted else log.last_seq
        if restarted:
            cursor = 0
        wake = asyncio.Event()
        self._wakes.add(wake)
        try:
            replay = log.since(cursor)      # OutOfRange before anything is sent
            log.watched = True   # from now on the host and disk tiers log their changes too
            head = rpb.WatchEventsResponse(epoch=log.epoch, last_seq=cursor)
            if restarted or replay.lost:
                first, last = replay.lost or (0, 0)
                head.gap.first_seq, head.gap.last_seq, head.gap.restarted = first, last, restarted
                head.last_seq = max(cursor, last)
            yield head
            while True:
                for msg in self._messages(replay.events, ns):
                    yield msg
                if replay.events:
                    cursor = replay.events[-1].seq
                while True:   # until there is more than this call has sent
                    wake.clear()
                    if self._stopping:
                        raise Unavailable("the daemon is shutting down; resume with the "
                                          "restarted daemon (its epoch differs: a gap is "
                                          "reported)")
                    if log.last_seq != cursor:
                        break
                    await wake.wait()
                # Asked again before each batch: a reload may have taken the
                # namespace's model from this token since the call began.
                self._authorize(context, model)
                replay = log.since(cursor)
                if replay.lost:
                    # Dropped from the buffer while this call lagged behind.
                    msg = rpb.WatchEventsResponse(epoch=log.epoch, last_seq=replay.lost[1])
                    msg.gap.first_seq, msg.gap.last_seq = replay.lost
                    yield msg
                    cursor = replay.lost[1]
        finally:
            self._wakes.discard(wake)

    def _messages(self, events: Sequence[ResidencyEvent],
                  ns: Optional[NamespaceId]) -> Iterator[rpb.WatchEventsResponse]:
        """`events` in messages of at most MESSAGE_KEYS keys (but one event
        each at least); each message's last_seq is the last event it covers,
        those filtered out before it included (a cursor to resume after)."""
        epoch = self.log.epoch
        msg = rpb.WatchEventsResponse(epoch=epoch)
        keys = 0
        for e in events:
            if ns is not None and e.namespace != ns:
                msg.last_seq = e.seq
                continue
            if msg.events and keys + len(e.keys) > MESSAGE_KEYS:
                yield msg
                msg = rpb.WatchEventsResponse(epoch=epoch)
                keys = 0
            msg.events.add(seq=e.seq, tier=tier_to_pb(e.tier), engine=e.engine,
                           kind=KIND_TO_PB[e.kind], namespace_id=e.namespace, keys=e.keys)
            msg.last_seq = e.seq
            keys += len(e.keys)
        if msg.events:
            yield msg


def placement_to_pb(p: Placement) -> rpb.LocateResponse:
    resp = rpb.LocateResponse(namespace_id=p.namespace, stored=p.stored)
    for e in p.engines:
        resp.engines.add(engine=e.engine, instance_id=e.instance_id, prefix=e.prefix,
                         resident_blocks=e.resident_blocks, capacity_blocks=e.capacity_blocks)
    for name, n in p.tiers:
        resp.tiers.add(tier=tier_to_pb(name), prefix=n)
    return resp
