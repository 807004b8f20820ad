"""The gRPC servicer: a thin asyncio adapter over the sans-I/O ledger and the tier stack.

Every handler reads the clock once, calls the ledger synchronously (no await
between a check and the mutation it guards, so no other RPC can interleave)
and converts the result. Match and CommitSave go through the tier stack,
which moves blocks between the tiers (tiers/stack.py); the servicer never
asks which tiers exist. Errors become status codes in api.status only.
"""
from __future__ import annotations

import logging
import time
from typing import Any, AsyncIterator, Callable

from kvkeeper.client.wire import (encode_block_chunk, encode_match_response, encode_stream_head,
                                  slice_views)
from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

from ..errors import (DeadlineExceeded, FailedPrecondition, InvalidArgument, OutOfRange,
                      ResourceExhausted, Unavailable)
from ..ids import LeaseId, SessionId
from ..ledger import Block, Lease, Ledger
from ..ledger.sessions import tag
from ..ops.traffic import NO_TRAFFIC, NoTraffic, TrafficRecorder
from ..tiers.stack import TierStack
from ..quoting import clip
from ..security import identity
from .convert import (SLOT_TO_PB, block_runs, descriptor_from_pb, fill_block_columns,
                      fill_block_runs, fill_refs, fill_slot_runs, fill_slots, report_from_pb,
                      tier_stats_to_pb, tier_to_pb)
from .chunks import (CHUNK_OVERHEAD_BYTES, STREAM_CHUNK_BYTES, STREAM_PACK_BYTES,
                     chunk_groups)
from .drain import Calls
from .handler import rpc, rpc_held, rpc_stream
from .watch import Watches

log = logging.getLogger("kvkeeper.api")

# Upper bounds of what one block adds to an answer, beyond its key: a BlockRef's
# tags, checksum and length prefix, and per extent (at most one per page).
REF_BYTES, EXTENT_BYTES = 32, 24


class KVKeeperServicer(pb_grpc.KVKeeperServicer):
    def __init__(self, ledger: Ledger, arena: Any, metrics: Any, *, version: str,
                 started_at: float, max_message_bytes: int, stack: TierStack,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self.stack = stack
        self.arena = arena
        self.metrics = metrics
        self.version = version
        self.started_at = started_at
        self.max_message_bytes = max_message_bytes
        # A chunk and its fields must fit the daemon's own message limit, or grpc
        # refuses to send it (RESOURCE_EXHAUSTED "Sent message larger than max").
        self.stream_chunk_bytes = min(STREAM_CHUNK_BYTES, max_message_bytes - CHUNK_OVERHEAD_BYTES)
        self.stream_pack_bytes = min(STREAM_PACK_BYTES, max_message_bytes - CHUNK_OVERHEAD_BYTES)
        self.clock = clock
        self.serving = True
        self.calls = Calls()
        # False after the admin Drain: ReserveSave answers UNAVAILABLE from then on.
        self.accepting_saves = True
        # Set when auth.tokens_file is: (context, model id) -> None or PermissionDenied.
        self.authorize_namespace: Callable[[Any, str], None] | None = None
        self.may_see_model: Callable[[Any, str], bool] | None = None   # the same, quietly
        # The open WatchSession calls (watch.py).
        self.watches = Watches(ledger, clock)
        self.traffic: "NoTraffic | TrafficRecorder" = NO_TRAFFIC   # [ledger] traffic_file
        self.arena_pb = pb.ShmArena(path=arena.path, size_bytes=arena.size_bytes,
                                    page_bytes=arena.page_bytes, arena_id=arena.arena_id)

    def _extents(self, b: Any) -> list[tuple[int, int]]:
        return self.arena.extents(b.pages, b.ns.pages_per_block, b.ns.block_bytes)

    # ------------------------------------------------------------ sessions
    @rpc
    async def RegisterSession(self, request: pb.RegisterSessionRequest, context: Any) -> pb.RegisterSessionResponse:
        if self.authorize_namespace is not None:
            self.authorize_namespace(context, request.namespace.model_id)
        s = self.ledger.register_session(
            request.instance_id, descriptor_from_pb(request.namespace), self.clock(),
            owner=identity.of(context))
        d = s.ns.descriptor
        # The tag, never the id: logs travel, and the id is half of a session's credential.
        log.info("session start %s instance=%s model=%s tp=%d/%d block=%dB", tag(s.id),
                 clip(s.instance_id), clip(d.model_id), d.tp_rank, d.tp_size, d.block_bytes)
        cfg = self.ledger.config
        return pb.RegisterSessionResponse(
            session_id=s.id, lease_ttl_seconds=cfg.lease_ttl_s, namespace_id=s.ns.id,
            arena=self.arena_pb, key_bytes=cfg.key_bytes, max_keys_per_call=cfg.max_keys_per_call,
            max_message_bytes=self.max_message_bytes)

    @rpc
    async def Heartbeat(self, request: pb.HeartbeatRequest, context: Any) -> pb.HeartbeatResponse:
        self.ledger.heartbeat(SessionId(request.session_id), self.clock(), identity.of(context))
        return pb.HeartbeatResponse(lease_ttl_seconds=self.ledger.config.lease_ttl_s)

    @rpc
    async def CloseSession(self, request: pb.CloseSessionRequest, context: Any) -> pb.CloseSessionResponse:
        self.ledger.close_session(SessionId(request.session_id), self.clock(), identity.of(context))
        log.info("session end %s reason=closed", tag(request.session_id))
        return pb.CloseSessionResponse()

    @rpc_held
    async def WatchSession(self, request: pb.WatchSessionRequest, context: Any) -> AsyncIterator[pb.SessionEvent]:
        """Held open while the session lives; its end from the client's side
        ends the session (see the proto and watch.py)."""
        async for event in self.watches.hold(SessionId(request.session_id), identity.of(context),
                                             context):
            yield event

    # ------------------------------------------------------------ match / load / release
    @rpc
    async def Match(self, request: pb.MatchRequest, context: Any) -> "pb.MatchResponse | bytes":
        sid = SessionId(request.session_id)
        owner = identity.of(context)
        r = await self.stack.match(sid, request.keys, lease=request.lease,
                                   report_use=request.report_use, owner=owner)
        self.traffic.match(sid, request.keys, r.lease_id, self.clock())
        if r.lease_id and _past_deadline(context):
            # The stack took longer than the caller waits (a promotion, a
            # stalled loop): grpc drops an answer past its deadline, so the
            # lease would stay pinned, unheard of, until the session ends.
            self.ledger.release(sid, r.lease_id, self.clock(), owner=owner)
            raise DeadlineExceeded(
                f"Match: the caller's deadline passed before the answer was ready; lease "
                f"{r.lease_id} released. Retry, with a longer deadline if this recurs")
        tiers = r.tiers
        if tiers and tiers.count(tiers[0]) == len(tiers):
            pb_tiers = [tier_to_pb(tiers[0])] * len(tiers)
        else:
            pb_tiers = [tier_to_pb(t) for t in tiers]
        # The gpu tier: another engine's cache may hold more (residency.py).
        holder, gpu_n = self.ledger.gpu_holder(sid, request.keys)
        gpu_engine = holder.engine if holder is not None else ""
        if not (request.blocks and r.lease_id):
            # The usual answer, serialized here (wire.py): no BlockRefs to carry.
            return encode_match_response(r.matched, pb_tiers, r.lease_id or 0, gpu_n, gpu_engine)
        resp = pb.MatchResponse(matched=r.matched, tiers=pb_tiers, lease_id=r.lease_id,
                                gpu_matched=gpu_n, gpu_engine=gpu_engine)
        # No await since the lease was granted (the stack promotes into the
        # arena before it), so its blocks are arena blocks, still pinned.
        # Taken from the table, not ledger.lease(): nothing may fail once a
        # lease exists that the client would never hear of.
        lease = self.ledger.leases[r.lease_id]
        self._block_refs(lease, resp.columns if request.columns else resp.blocks)
        if self._too_big(resp, len(lease.blocks), lease.session.ns.pages_per_block):
            # grpc would refuse to send it and the lease would be lost: answer
            # without the refs, as a daemon that ignores `blocks` does; the
            # client then asks Load, which says what is too big.
            del resp.blocks[:]
            resp.ClearField("columns")
        else:
            self._refs_sent(lease)
        return resp

    def _too_big(self, resp: Any, blocks: int, pages_per_block: int) -> bool:
        """Whether `resp` exceeds server.max_message_bytes (which grpc enforces on
        sending). Exact only when a cheap bound says it might: never on the usual path."""
        per_block = self.ledger.config.key_bytes + REF_BYTES + EXTENT_BYTES * pages_per_block
        if blocks * per_block + 64 <= self.max_message_bytes:
            return False
        return resp.ByteSize() > self.max_message_bytes

    @rpc
    async def Load(self, request: pb.LoadRequest, context: Any) -> pb.LoadResponse:
        now = self.clock()
        lease = self.ledger.lease(SessionId(request.session_id), request.lease_id, now,
                                  identity.of(context))
        resp = pb.LoadResponse()
        self._block_refs(lease, resp.columns if request.columns else resp.blocks)
        if self._too_big(resp, len(lease.blocks), lease.session.ns.pages_per_block):
            raise ResourceExhausted(
                f"the refs of lease {lease.id} take {resp.ByteSize()} bytes, above this daemon's "
                f"server.max_message_bytes ({self.max_message_bytes}); release it and match "
                "fewer keys per call, or use LoadStream")
        self._refs_sent(lease)
        self.ledger.renew(lease.session, now)
        return resp

    def _block_refs(self, lease: Lease, out: Any) -> None:
        """The leased blocks' refs, into `out`: a repeated BlockRef field
        (Load's answer, or Match's with blocks=true) or a BlockColumns (either's,
        asked with columns). The client copies the bytes itself, so handing
        out the refs is where a same-host load is counted, with no duration
        the daemon could see; for a report_use lease, when the Release
        reports which blocks were loaded."""
        blocks: list[Block] = lease.blocks
        keys = [b.key for b in blocks]
        sums = [b.checksum or (0, 0) for b in blocks]
        if not isinstance(out, pb.BlockColumns):
            fill_refs(out, keys, sums, [self._extents(b) for b in blocks])
        elif (runs := block_runs(self.arena, blocks)) is not None:
            fill_block_runs(out, keys, sums, *runs)   # the usual answer: one run of pages each
        else:
            fill_block_columns(out, keys, sums, [self._extents(b) for b in blocks])

    def _refs_sent(self, lease: Lease) -> None:
        """The refs _block_refs filled go out: only now a same-host load (an
        answer too big to send hands out nothing)."""
        lease.refs_out = True
        if not lease.report_use:
            self.metrics.observe_transfer("load", "shm",
                                          sum(b.ns.block_bytes for b in lease.blocks), None)

    @rpc_stream
    async def LoadStream(self, request: pb.LoadRequest, context: Any) -> AsyncIterator[bytes]:
        """Yields serialized BlockChunks (wire.frame_or_message sends them as
        they are), each built in one copy from the arena: a block per chunk,
        a block in chunks if it is larger than one, or with pack_blocks as
        many whole blocks as a chunk holds."""
        t0 = time.perf_counter()
        sid, owner = SessionId(request.session_id), identity.of(context)
        if request.lease_id or not request.keys:
            lease = self.ledger.lease(sid, request.lease_id, self.clock(), owner)
        else:
            # Keyed: Match's lease, then its stream, in one call.
            r = await self.stack.match(sid, request.keys, lease=True,
                                       report_use=request.report_use, owner=owner)
            # Taken from the table before any yield: nothing may fail between
            # granting the lease and telling the client which it is.
            lease = self.ledger.leases[r.lease_id] if r.lease_id else None
            yield encode_stream_head(r.lease_id or 0, r.matched)
            if lease is None:
                return
        # narrow() gives the lease a new list of fewer blocks and unpins the
        # rest, whose pages may then hold another namespace's blocks: the
        # stream goes on only while the lease still holds this list.
        held = lease.blocks
        blocks = list(held)
        step = self.stream_chunk_bytes
        nbytes = 0
        pack = self.stream_pack_bytes if request.pack_blocks else 0
        for i, group in chunk_groups(blocks, pack):
            first = group[0]
            size = first.ns.block_bytes
            algo, value = first.checksum or (0, 0)
            sums = [(b.checksum or (0, 0))[1] for b in group] if len(group) > 1 else ()
            for off in range(0, size, step):
                # Between yields another RPC may release the lease and its pages
                # may be reused, so each frame is copied out of the arena only
                # while the lease is known live, with no await in between. One
                # frame at a time: it is still in cache when grpc copies it.
                if self.ledger.leases.get(lease.id) is not lease:
                    raise FailedPrecondition(
                        f"lease {lease.id} was released while it was being streamed")
                if lease.blocks is not held:
                    raise FailedPrecondition(
                        f"lease {lease.id} was narrowed (Release with keep_blocks) while it was "
                        "being streamed; narrow a lease after its LoadStream ends")
                views = [self.arena.view(o, n) for b in group for o, n in self._extents(b)]
                if sums:
                    frame = encode_block_chunk(i, 0, views, algo, 0, sums)
                else:
                    frame = encode_block_chunk(i, off, slice_views(views, off, step),
                                               algo if off == 0 else 0, value if off == 0 else 0)
                del views   # the arena cannot unmap while views of it live
                yield frame
                if sums:
                    break
            nbytes += size * len(group)
        self.metrics.observe_transfer("load", "stream", nbytes, time.perf_counter() - t0)
        self.ledger.renew(lease.session, self.clock())

    @rpc
    async def Release(self, request: pb.ReleaseRequest, context: Any) -> pb.ReleaseResponse:
        sid, now, owner = SessionId(request.session_id), self.clock(), identity.of(context)
        if request.keep_blocks:
            if (request.discard or request.discard_indices or request.HasField("report")
                    or request.last_turn):
                raise InvalidArgument("keep_blocks narrows a lease: send discards, last_turn "
                                      "and the report with the Release that ends it")
            self.ledger.narrow(sid, request.lease_id, request.keep_start, request.keep_blocks, now,
                               owner)
            return pb.ReleaseResponse()
        report = report_from_pb(request.report) if request.HasField("report") else None
        lease = self.ledger.leases.get(LeaseId(request.lease_id))
        loaded = self.ledger.release(sid, request.lease_id, now, discard=request.discard,
                                     discard_indices=request.discard_indices, report=report,
                                     owner=owner, last_turn=request.last_turn)
        self.traffic.released(request.lease_id, request.last_turn, now)
        if loaded and lease is not None and lease.refs_out:
            self.metrics.observe_transfer("load", "shm", loaded * lease.session.ns.block_bytes,
                                          None)
        return pb.ReleaseResponse()

    # ------------------------------------------------------------ save
    @rpc
    async def ReserveSave(self, request: pb.ReserveSaveRequest, context: Any) -> pb.ReserveSaveResponse:
        if not self.accepting_saves:
            raise Unavailable("draining: this daemon accepts no new saves (kvkeeper drain) "
                              "until it restarts; skip the save")
        now, sid, owner = self.clock(), SessionId(request.session_id), identity.of(context)
        if request.transport not in _TRANSPORTS:
            self.ledger.session(sid, now, owner)   # another's session: NOT_FOUND first, as ever
            raise InvalidArgument(f"transport {request.transport} is unknown; use TRANSPORT_SHM "
                                  "(same host) or TRANSPORT_STREAM")
        stream = request.transport == pb.TRANSPORT_STREAM
        parent = request.parent_key if request.HasField("parent_key") else None
        try:
            r = self.ledger.reserve(sid, request.keys, now, track_writes=stream, parent=parent,
                                    owner=owner)
        finally:   # what the client asked to save, kept or not (a full tier refuses it)
            self.traffic.saved(sid, request.keys, parent, now)
        resp = pb.ReserveSaveResponse(reservation_id=r.reservation_id or 0,
                                      expires_in_seconds=r.expires_at - now, pack_writes=stream)
        statuses = [SLOT_TO_PB[s] for s in r.statuses]
        runs = block_runs(self.arena, r.blocks) if request.columns and not stream else None
        if runs is not None:   # the usual answer: each block one run of pages
            fill_slot_runs(resp, statuses, *runs)
            return resp
        fill_slots(resp, statuses,
                   [() if b is None or stream else self._extents(b) for b in r.blocks],
                   request.columns)
        return resp

    @rpc
    async def WriteBlocks(self, request_iterator: Any, context: Any) -> pb.WriteBlocksResponse:
        t0 = time.perf_counter()
        res = None
        total = 0
        owner = identity.of(context)
        async for chunk in request_iterator:
            if res is None:
                res = self.ledger.reservation(SessionId(chunk.session_id), chunk.reservation_id,
                                              self.clock(), owner)
            else:
                if self.ledger.reservations.get(res.id) is not res:
                    raise FailedPrecondition(f"reservation {res.id} closed (aborted or timed "
                                             "out) while data was streaming")
                if (chunk.reservation_id and chunk.reservation_id != res.id) or \
                        (chunk.session_id and chunk.session_id != res.session.id):
                    # Its bytes would land in this reservation's blocks.
                    raise InvalidArgument(
                        f"a WriteChunk names reservation {chunk.reservation_id} of session "
                        f"{clip(chunk.session_id)!r} in a stream of reservation {res.id}; one "
                        "WriteBlocks per reservation (later chunks may leave both empty)")
            total += self._write_chunk(res, chunk)
        self.metrics.observe_transfer("save", "stream", total, time.perf_counter() - t0)
        if res is not None:
            self.ledger.renew(res.session, self.clock())
        return pb.WriteBlocksResponse(bytes_written=total)

    def _write_chunk(self, res: Any, chunk: Any) -> int:
        """Store one WriteChunk: part of a block, or (pack_writes) several
        whole blocks from entry chunk.index on. Returns its bytes."""
        data, bb = chunk.data, res.session.ns.block_bytes
        n = len(data)
        if n <= bb or chunk.offset:
            b = self.ledger.record_write(res, chunk.index, chunk.offset, n)
            self.arena.write(self._extents(b), data, chunk.offset)
            return n
        if n % bb:
            raise OutOfRange(f"key {chunk.index}: {n} bytes is past the block size {bb} and "
                             "no whole number of blocks (a packed chunk's)")
        # Every entry checked before any is recorded: a chunk that fails changes nothing.
        for j, b in enumerate(self.ledger.record_whole(res, chunk.index, n // bb)):
            self.arena.write(self._extents(b), data[j * bb:(j + 1) * bb], 0)
        return n

    @rpc
    async def CommitSave(self, request: pb.CommitSaveRequest, context: Any) -> pb.CommitSaveResponse:
        now = self.clock()
        sid, owner = SessionId(request.session_id), identity.of(context)
        res = self.ledger.reservation(sid, request.reservation_id, now, owner)
        shm = res.written is None
        blocks = res.blocks
        nbytes = sum(b.ns.block_bytes for b in blocks)
        # Reserve to commit is what a same-host save costs, the client's copy included.
        reserved_at = res.expires_at - self.ledger.config.reservation_timeout_s
        committed = self.ledger.commit(sid, request.reservation_id, now,
                                       checksum_algo=request.checksum_algo,
                                       checksums=request.checksums, owner=owner)
        if shm:
            self.metrics.observe_transfer("save", "shm", nbytes, now - reserved_at)
        if blocks:
            # Write-through answers only once the blocks are in the tiers below.
            await self.stack.committed(res.session.ns, [b.key for b in blocks])
        return pb.CommitSaveResponse(committed=committed)

    @rpc
    async def AbortSave(self, request: pb.AbortSaveRequest, context: Any) -> pb.AbortSaveResponse:
        self.ledger.abort(SessionId(request.session_id), request.reservation_id, self.clock(),
                          identity.of(context))
        return pb.AbortSaveResponse()

    # ------------------------------------------------------------ stats
    @rpc
    async def Stats(self, request: pb.StatsRequest, context: Any) -> pb.StatsResponse:
        L = self.ledger
        u = L.usage
        tiers = self.stack.tier_stats()
        return pb.StatsResponse(
            version=self.version, uptime_seconds=time.monotonic() - self.started_at,
            tiers=[tier_stats_to_pb(t) for t in tiers],
            sessions=len(L.sessions), leases=len(L.leases), reservations=len(L.reservations),
            namespaces=len(L.namespaces), lookups=L.lookups, lookup_keys=L.lookup_keys,
            hit_blocks=sum(t.hit_blocks for t in tiers), eviction_policy=L.config.policy,
            hit_tokens=sum(t.hit_tokens for t in tiers),
            lookup_blocks=u.lookup_blocks, lookup_tokens=u.lookup_tokens,
            prompt_blocks=u.prompt_blocks, prompt_tokens=u.prompt_tokens,
            tier_series=[pb.TierSeries(name=c.name, kind=c.kind, labels=dict(c.labels),
                                       value=c.value) for c in self.stack.counters()],
            engines=[pb.EngineStats(engine=b.engine, instance_id=b.instance_id,
                                    namespace_id=b.namespace, resident_blocks=len(b.blocks),
                                    resident_bytes=b.resident_bytes,
                                    capacity_blocks=b.capacity_blocks)
                     for b in L.residency.books.values() if self._may_see(context, b.namespace)])

    def _may_see(self, context: Any, ns_id: bytes) -> bool:
        """Whether the caller's token covers namespace `ns_id`'s model: Stats
        shows a tenant only its own engines (their instance ids name hosts)."""
        if self.may_see_model is None:
            return True
        ns = self.ledger.namespaces.get(ns_id)   # type: ignore[call-overload]
        return ns is not None and self.may_see_model(context, ns.descriptor.model_id)


_TRANSPORTS = (pb.TRANSPORT_UNSPECIFIED, pb.TRANSPORT_SHM, pb.TRANSPORT_STREAM)


def _past_deadline(context: Any) -> bool:
    """Whether the caller's deadline has passed (by the clock, so it holds
    even when the event loop has not yet seen the cancellation). The match
    lane's context has none: it checks its caller's socket instead."""
    left = getattr(context, "time_remaining", None)
    t = left() if left is not None else None
    return t is not None and t <= 0
