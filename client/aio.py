"""asyncio client of the kvkeeper daemon (grpc.aio).

One AsyncClient is one session for one namespace. It hides what a vLLM
connector should not have to handle itself, each in a module of its own:

* keeping the session alive and registering again when the daemon
  restarted or the session expired (session.py);
* retrying calls that did not reach the daemon (UNAVAILABLE) when they are
  idempotent, with backoff and jitter (retry.py, used by session.py);
* choosing the byte path: shared memory when the daemon's arena can be mapped
  (same host), gRPC streams otherwise, and falling back to streams when the
  arena goes away (transport.py);
* checksums: XXH3-64 (or CRC32) of every saved block goes to the daemon at
  commit and is checked on every load with the algorithm the block was stored
  with, so corruption anywhere in between is caught (checksum.py; saves.py,
  loads.py);
* the daemon's limits (max keys per call) and the caller's mistakes (wrong
  key or block sizes), checked before anything is sent (checks.py).

The operations themselves live in leases.py (match, release, narrow),
loads.py and saves.py; this module connects, closes and documents them.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, List, Mapping, Optional, Sequence, Tuple

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import residency_pb2 as rpb

from .auth import TLSLike, aio_channel, bearer_metadata
from .checksum import DEFAULT as DEFAULT_CHECKSUM, algo_of
from .errors import from_rpc_error
from .leases import Leases, MatchResult
from .loads import Loads
from .match_lane import AsyncMatchLane, lane_for
from .saves import SaveResult, Saves
from .session import Metadata, NamespaceLike, Session, namespace_descriptor
from .transport import Transport
from .url import to_grpc_target
from .wire import Chunk

__all__ = ["AsyncClient", "CHANNEL_OPTIONS", "MAX_MESSAGE_BYTES"]

MAX_MESSAGE_BYTES = 64 << 20
RESIDENCY_KINDS = {"stored": rpb.RESIDENCY_STORED, "removed": rpb.RESIDENCY_REMOVED,
                   "cleared": rpb.RESIDENCY_CLEARED}
CHANNEL_OPTIONS = [
    ("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
    ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
    # A restarted daemon is usually back within a second; gRPC's default
    # reconnect backoff (1 s growing to 120 s) would outlast our retries.
    # Capped at 0.5 s so that a daemon back from a restart is found within
    # that (an attempt on a unix socket or a refused TCP port costs nothing).
    ("grpc.initial_reconnect_backoff_ms", 100),
    ("grpc.min_reconnect_backoff_ms", 100),
    ("grpc.max_reconnect_backoff_ms", 500),
]


class AsyncClient:
    """A session with the daemon. Create with `await AsyncClient.connect(...)`.

    Use from one event loop (the one that connected). Concurrent calls on
    that loop are fine.
    """

    def __init__(self, channel: grpc.aio.Channel, namespace: pb.NamespaceDescriptor, *,
                 instance_id: str, timeout: float, transport: Transport, checksum: str,
                 max_retries: int, metadata: Metadata, copy_threads: int = 0,
                 lane: Optional[AsyncMatchLane] = None) -> None:
        self._channel = channel
        self._health = health_pb2_grpc.HealthStub(channel)
        self._timeout = timeout
        self._transport = transport
        self._copy_threads = copy_threads
        self._session = Session(channel, namespace, instance_id=instance_id, timeout=timeout,
                                max_retries=max_retries, metadata=metadata,
                                on_arena=transport.update, lane=lane)
        algo = algo_of(checksum)
        self._loads = Loads(self._session, transport, algo, copy_threads)
        self._saves = Saves(self._session, transport, algo, copy_threads)
        self._leases = Leases(self._session, transport, self._loads)

    # ---- lifecycle

    @classmethod
    async def connect(cls, url: str, namespace: NamespaceLike, *, instance_id: str = "",
                      timeout: float = 5.0, transport: str = "auto",
                      checksum: str = DEFAULT_CHECKSUM, max_retries: int = 5, token: Optional[str] = None,
                      tls: TLSLike = None, copy_threads: int = 0,
                      match_lane: bool = True) -> "AsyncClient":
        """Open a channel to `url`, register a session and start heartbeats.

        timeout: deadline of every RPC, in seconds (a stream's deadline covers
        the whole stream). transport: "auto" maps the daemon's arena when it can
        and streams otherwise; "shm" fails here if the arena cannot be mapped;
        "stream" never maps. checksum: "xxh3" (the default) or "crc32" sends
        that checksum at commit; loads verify each block with the algorithm it
        was stored with (old CRC32 blocks too); "none" does neither. max_retries: retries of an
        idempotent call on UNAVAILABLE. token: bearer token sent with every call
        (daemons with auth.tokens_file). tls: None (plain), True (system roots) or
        kvkeeper.client.auth.TLS(ca_file, cert_file, key_file); see client/auth.py.
        copy_threads: threads that copy (and checksum) a same-host save or
        load of 16 MiB or more at once, a shard of its blocks each; 0 (auto):
        as many as the CPUs the calling thread may run on, at most 4.
        match_lane: on a unix socket without TLS or a token, Match calls go
        on the daemon's match lane (client/match_lane.py) where it has one;
        False keeps them on gRPC.
        """
        byte_path = Transport(transport)
        algo_of(checksum)   # ValueError naming the choices, before anything connects
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries!r}")
        if isinstance(copy_threads, bool) or not isinstance(copy_threads, int) or copy_threads < 0:
            raise ValueError(f"copy_threads must be an int >= 0 (0: auto), got {copy_threads!r}")
        target = to_grpc_target(url)
        ns = namespace_descriptor(namespace)
        metadata = bearer_metadata(token)
        channel = aio_channel(target, tls, CHANNEL_OPTIONS)
        self = cls(channel, ns, instance_id=instance_id, timeout=float(timeout),
                   transport=byte_path, checksum=checksum, max_retries=int(max_retries),
                   metadata=metadata, copy_threads=copy_threads,
                   lane=lane_for(target, tls, token, AsyncMatchLane) if match_lane else None)
        try:
            await self._session.register(initial=True)
        except BaseException:
            await self.close()  # also closes a session registered before the failure
            raise
        self._session.start_heartbeats()
        return self

    async def close(self, timeout: Optional[float] = None) -> None:
        """Close the session (best effort, within `timeout` seconds: by default
        the client's deadline), stop heartbeats, unmap, close the channel.
        Idempotent. The daemon releases this session's leases and reservations."""
        if self._session.closed:
            return
        try:
            await self._session.close(timeout)
        finally:
            self._transport.close()
            await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- properties

    @property
    def session_id(self) -> str:
        return self._session.id

    @property
    def refused(self) -> bool:
        """Whether the daemon refused to register this client's lost session
        again, and its backoff holds (refusal.py): calls fail without an RPC."""
        return self._session.refusal.holds()

    @property
    def namespace(self) -> pb.NamespaceDescriptor:
        return self._session.namespace

    @property
    def namespace_id(self) -> bytes:
        return self._session.namespace_id

    @property
    def key_bytes(self) -> int:
        return self._session.key_bytes

    @property
    def block_bytes(self) -> int:
        return self._session.namespace.block_bytes

    @property
    def max_keys_per_call(self) -> int:
        return self._session.max_keys

    @property
    def lease_ttl_seconds(self) -> float:
        return self._session.lease_ttl

    @property
    def transport(self) -> str:
        """The byte path in use now: "shm" or "stream"."""
        return self._transport.name

    @property
    def copy_threads(self) -> int:
        """As given to connect (0: auto; see kvkeeper.client.copies.copy_threads)."""
        return self._copy_threads

    @property
    def arena_id(self) -> Optional[bytes]:
        """The id of the arena this client has mapped (None: streaming). Block
        refs from another process's Match are only meaningful in the same arena."""
        m = self._transport.mapping
        return m.arena_id if m is not None else None

    @property
    def arena_mapping(self) -> Optional[Any]:
        """The arena mapping in use now (an ArenaMapping), or None: for
        registering it as pinned GPU memory (kvkeeper.client.pinned)."""
        return self._transport.mapping

    @property
    def closed(self) -> bool:
        return self._session.closed

    # ---- API

    async def renew(self) -> None:
        """Heartbeat now, and register again if the daemon lost the session (it
        restarted, or the session expired). Raises what the daemon answered
        otherwise, e.g. UnavailableError while it is down."""
        await self._session.renew()

    async def match(self, keys: Sequence[bytes], lease: bool = False,
                    blocks: bool = False, report_use: bool = False) -> MatchResult:
        """How many leading `keys` (chained, prefix order) the daemon holds.

        With lease=True the matched blocks stay pinned until `release`; a
        leased match looks at the first max_keys_per_call keys only (one lease
        per call), an unleased one splits longer lists itself.

        blocks=True (only with lease=True, else ValueError) also fills
        MatchResult.blocks with what a Load of the lease would return, in the
        same round trip, for `arena_views`. A client that streams (no arena
        mapped) does not ask for them, since it could not use them: `blocks`
        stays empty, arena_views returns None and `load_into` streams.

        report_use=True: the daemon counts no hit for this lookup; say what
        it was used for with `release(..., report=...)` (lease_id 0 when
        nothing was leased).
        """
        return await self._leases.match(keys, lease, blocks, report_use)

    def arena_views(self, refs: Sequence[Any]) -> Optional[List[List[memoryview]]]:
        """Zero-copy views of blocks in the mapped arena: for each BlockRef (from
        MatchResult.blocks; or its copies.stored tuple, plain data for another
        process), read-only memoryviews of its extents, in order;
        together they hold block_bytes bytes. None when no arena is mapped
        (streaming client, arena gone, client closed): use `load_into` then.

        The views are valid only while the lease is held: after `release` the
        pages may be evicted and reused for other blocks. Read-only because
        the pages are shared with every other reader of the block. A mapping
        closed meanwhile stays mapped until the views are dropped (see
        ArenaMapping.close). Checksums are not verified here (that would read
        every byte); each ref carries checksum_algo and checksum for a caller
        that checks its own copy, as `load_into` does.

        Synchronous and safe from any thread: it only reads the mapping.
        """
        return self._loads.arena_views(refs)

    async def load(self, lease_id: int) -> List[bytes]:
        """The bytes of every block of the lease, in lease order."""
        return await self._loads.load(lease_id)

    async def load_into(self, lease_id: int, outs: Sequence[Any]) -> None:
        """Copy the lease's blocks into `outs` (writable C-contiguous buffers of
        at least block_bytes each, one per leased block, in lease order, none
        overlapping another: a large load fills them from several threads).
        On ChecksumError every buffer is filled; the bad ones are listed."""
        await self._loads.load_into(lease_id, outs)

    def load_chunks(self, lease_id: int,
                    max_blocks: Optional[int] = None) -> AsyncIterator[Chunk]:
        """Stream the lease's blocks, yielding each chunk as it arrives: a
        kvkeeper.client.wire.Chunk (index in the lease, byte offset in the
        block, data: a read-only view of the received message, valid as long
        as it is referenced; a block's first chunk also carries the checksum
        it was committed with). Each chunk is checked to lie within
        block_bytes (and, with max_blocks, within that many blocks) before it
        is yielded; once the stream ends, that every block arrived whole
        (KVKeeperClientError otherwise: nothing received may be used then).

        For callers that put the bytes where they belong as they arrive (the
        connector copies them into the KV cache): checksums are not verified
        here, and the stream is not retried (load_into does both). Nothing is
        sent before the first chunk is asked for."""
        return self._loads.load_chunks(lease_id, max_blocks)

    async def save(self, keys: Sequence[bytes], blocks: Sequence[Any],
                   parent: Optional[bytes] = None) -> SaveResult:
        """Store blocks[i] under keys[i]: reserve, write the reserved ones,
        commit. Keys the daemon already has or another writer holds are
        skipped. Lists longer than max_keys_per_call go in several rounds; on
        an error, rounds already committed stay committed.

        The keys are a run of one chain (each key's parent is the key before
        it); `parent` is the key before keys[0] (b"" when keys[0] starts the
        chain, None when unknown): the daemon keeps a parent cached behind
        its children, so a save that continues a chain should name it."""
        return await self._saves.save(keys, blocks, parent)

    async def release(self, lease_id: int, discard: bool = False,
                      discard_indices: Sequence[int] = (),
                      report: Optional[Mapping[str, int]] = None,
                      last_turn: bool = False) -> None:
        """Unpin the lease's blocks. discard=True also drops every block of the
        lease nobody else references; discard_indices drops just those lease
        positions (e.g. ChecksumError.bad_indices). report: the fields of a
        LookupReport (prompt_tokens, prompt_blocks, local_blocks,
        loaded_blocks) for a lookup made with report_use; lease_id may be 0.
        last_turn=True: the lookup was a conversation's last turn, so the
        blocks nobody else holds go first in line for eviction (a hit by
        another request takes them back)."""
        await self._leases.release(lease_id, discard, discard_indices, report, last_turn)

    async def narrow(self, lease_id: int, start: int, count: int) -> None:
        """Unpin the lease's blocks outside positions [start, start + count); the
        lease keeps the rest, at positions 0..count-1."""
        await self._leases.narrow(lease_id, start, count)

    async def stats(self) -> pb.StatsResponse:
        """The daemon's counters (tiers, sessions, leases, hits...)."""
        return await self._session.unary("Stats", lambda s: pb.StatsRequest(), retry=True,
                                         rebind=False)

    async def report_residency(self, changes: Sequence[Tuple[str, Sequence[bytes]]], *,
                               capacity_blocks: int = 0,
                               report_seq: int = 0) -> Tuple[Any, str]:
        """ReportResidency (residency.proto): this session's engine's KV cache
        changed; changes: ("stored" | "removed" | "cleared", keys), in order.
        Retried on UNAVAILABLE (report_seq makes a repeat harmless), never
        moved to a new session (its book would miss what was said before).
        Returns the answer and the session id it went to."""
        req_changes = [rpb.ResidencyChange(kind=RESIDENCY_KINDS[kind], keys=list(keys))
                       for kind, keys in changes]
        return await self._session.unary_sid(
            "ReportResidency", lambda s: rpb.ReportResidencyRequest(
                session_id=s, capacity_blocks=capacity_blocks, report_seq=report_seq,
                changes=req_changes), retry=True, rebind=False)

    async def health(self, service: str = "") -> str:
        """grpc.health.v1 status name: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"
        or "UNKNOWN". Not retried: a probe should report the present."""
        self._session.check_open()
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                            timeout=self._timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "Health.Check") from e
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
