"""asyncio client of the kvkeeper daemon (grpc.aio).

One AsyncClient is one session for one namespace. It hides what a vLLM
connector should not have to handle itself:

* keeping the session alive (a heartbeat task every lease TTL / 3) and
  registering again when the daemon restarted or the session expired;
* retrying calls that did not reach the daemon (UNAVAILABLE) when they are
  idempotent, with backoff and jitter (see retry.py);
* choosing the byte path: shared memory when the daemon's arena can be mapped
  (same host), gRPC streams otherwise, and falling back to streams when the
  arena goes away;
* checksums: XXH3-64 (or CRC32) of every saved block goes to the daemon at
  commit and is checked on every load with the algorithm the block was stored
  with, so corruption anywhere in between is caught;
* the daemon's limits (max keys per call) and the caller's mistakes (wrong
  key or block sizes), checked before anything is sent.

Calls that carry an id issued to an earlier session (lease, reservation) are
never replayed after a re-registration: the daemon released them with that
session, and the caller must match again.
"""
from __future__ import annotations

import asyncio
import logging
from dataclasses import dataclass, field
from typing import (Any, AsyncIterator, Callable, List, Mapping, Optional, Sequence, Tuple,
                    Union)

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

from .auth import TLSLike, aio_channel, bearer_metadata
from .checksum import ALGOS, DEFAULT as DEFAULT_CHECKSUM, algo_of, byte_view
from .errors import (ChecksumError, FailedPreconditionError, KVKeeperClientError,
                     from_rpc_error, is_session_lost)
from .retry import call_with_retry
from .stream import (Coverage, chunks, load_stream_method, protocol_error, write_blocks_method,
                     write_frames)
from .url import to_grpc_target
from .wire import Chunk

__all__ = ["AsyncClient", "MatchResult", "SaveResult", "CHANNEL_OPTIONS", "MAX_MESSAGE_BYTES",
           "WRITE_CHUNK_BYTES"]

log = logging.getLogger(__name__)

MAX_MESSAGE_BYTES = 64 << 20
WRITE_CHUNK_BYTES = 1 << 20
# Checksumming more than this many bytes runs in a worker thread (zlib and xxhash drop
# the GIL), so one large save or load does not stall heartbeats and other calls.
_OFFLOAD_BYTES = 4 << 20
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
_TRANSPORTS = ("auto", "shm", "stream")

NamespaceLike = Union[Mapping[str, Any], pb.NamespaceDescriptor]


@dataclass(frozen=True)
class MatchResult:
    """`matched` leading keys are cached; `tiers[i]` is a kvkeeper_pb2.Tier value;
    `lease_id` is None unless a lease was asked for and something matched.
    `blocks`: with match(..., lease=True, blocks=True) on a client that maps
    the arena, the leased blocks' kvkeeper_pb2.BlockRef (arena extents and
    checksum), one per leased block in lease order, for `arena_views`; else empty."""

    matched: int
    tiers: List[int]
    lease_id: Optional[int]
    blocks: List[pb.BlockRef] = field(default_factory=list)


@dataclass(frozen=True)
class SaveResult:
    """Per-key outcome counts: written and `committed`, or skipped because
    `present` (already cached) or `in_flight` (another writer has it)."""

    reserved: int
    present: int
    in_flight: int
    committed: int


def _namespace(ns: NamespaceLike) -> pb.NamespaceDescriptor:
    if isinstance(ns, pb.NamespaceDescriptor):
        out = pb.NamespaceDescriptor()
        out.CopyFrom(ns)
    elif isinstance(ns, Mapping):
        try:
            out = pb.NamespaceDescriptor(**ns)
        except (ValueError, TypeError) as e:
            raise ValueError(f"invalid namespace {dict(ns)!r}: {e}") from None
    else:
        raise ValueError("namespace must be a dict or a kvkeeper_pb2.NamespaceDescriptor, "
                         f"got {type(ns).__name__}")
    if out.block_bytes <= 0:
        raise ValueError("namespace block_bytes must be > 0")
    return out


class AsyncClient:
    """A session with the daemon. Create with `await AsyncClient.connect(...)`.

    Use from one event loop (the one that connected). Concurrent calls on
    that loop are fine.
    """

    def __init__(self, channel: grpc.aio.Channel, namespace: pb.NamespaceDescriptor, *,
                 instance_id: str, timeout: float, transport: str, checksum: str,
                 max_retries: int) -> None:
        self._channel = channel
        self._stub = pb_grpc.KVKeeperStub(channel)
        # The bulk messages go through kvkeeper.client.wire (fewer copies, same bytes).
        self._load_stream_rpc = load_stream_method(channel)
        self._write_blocks_rpc = write_blocks_method(channel)
        self._health = health_pb2_grpc.HealthStub(channel)
        self._ns = namespace
        self._instance_id = instance_id
        self._timeout = timeout
        self._mode = transport
        self._checksum_algo = algo_of(checksum)
        self._max_retries = max_retries
        self._session_id = ""
        self._namespace_id = b""
        self._lease_ttl = 0.0
        self._key_bytes = 0
        self._max_keys = 0
        self._max_message_bytes = 0
        self._mapping: Any = None  # kvkeeper.client.shm.ShmMapping, or None: stream
        self._register_lock = asyncio.Lock()
        self._heartbeat_task: Optional[asyncio.Task] = None
        self._closed = False
        self._metadata: Optional[Tuple[Tuple[str, str], ...]] = None  # the bearer token, if any

    # ---- lifecycle

    @classmethod
    async def connect(cls, url: str, namespace: NamespaceLike, *, instance_id: str = "",
                      timeout: float = 5.0, transport: str = "auto",
                      checksum: str = DEFAULT_CHECKSUM, max_retries: int = 5,
                      token: Optional[str] = None, tls: TLSLike = None) -> "AsyncClient":
        """Open a channel to `url`, register a session and start heartbeats.

        timeout: deadline of every RPC, in seconds (a stream's deadline covers
        the whole stream). transport: "auto" maps the daemon's arena when it can
        and streams otherwise; "shm" fails here if the arena cannot be mapped;
        "stream" never maps. checksum: "xxh3" (the default) or "crc32" sends
        that checksum at commit; loads verify each block with the algorithm it
        was stored with (old CRC32 blocks too); "none" does neither.
        max_retries: retries of an idempotent call on UNAVAILABLE. token: bearer token sent with every call
        (daemons with auth.tokens_file). tls: None (plain), True (system roots) or
        kvkeeper.client.auth.TLS(ca_file, cert_file, key_file); see client/auth.py.
        """
        if transport not in _TRANSPORTS:
            raise ValueError(f"transport must be one of {_TRANSPORTS}, got {transport!r}")
        algo_of(checksum)   # ValueError naming the choices, before anything connects
        if not timeout or timeout <= 0:
            raise ValueError(f"timeout must be > 0 seconds, got {timeout!r}")
        if max_retries < 0:
            raise ValueError(f"max_retries must be >= 0, got {max_retries!r}")
        target = to_grpc_target(url)
        ns = _namespace(namespace)
        metadata = bearer_metadata(token)
        channel = aio_channel(target, tls, CHANNEL_OPTIONS)
        self = cls(channel, ns, instance_id=instance_id, timeout=float(timeout),
                   transport=transport, checksum=checksum, max_retries=int(max_retries))
        self._metadata = metadata
        try:
            self._apply_registration(await self._register(), initial=True)
        except BaseException:
            await self.close()  # also closes a session registered before the failure
            raise
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(),
                                                   name=f"kvkeeper-heartbeat-{self._session_id}")
        return self

    async def close(self, timeout: Optional[float] = None) -> None:
        """Close the session (best effort, within `timeout` seconds: by default
        the client's deadline), stop heartbeats, unmap, close the channel.
        Idempotent. The daemon releases this session's leases and reservations."""
        if self._closed:
            return
        self._closed = True
        task, self._heartbeat_task = self._heartbeat_task, None
        if task is not None:
            task.cancel()
            try:
                await task
            except (asyncio.CancelledError, Exception):
                pass
        try:
            if self._session_id:
                await self._stub.CloseSession(pb.CloseSessionRequest(session_id=self._session_id),
                                              timeout=timeout or self._timeout,
                                              metadata=self._metadata)
        except Exception as e:  # the daemon expires the session by itself
            log.debug("CloseSession failed: %s", e)
        finally:
            mapping, self._mapping = self._mapping, None
            if mapping is not None:
                mapping.close()
            await self._channel.close()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- properties

    @property
    def session_id(self) -> str:
        return self._session_id

    @property
    def namespace(self) -> pb.NamespaceDescriptor:
        return self._ns

    @property
    def namespace_id(self) -> bytes:
        return self._namespace_id

    @property
    def key_bytes(self) -> int:
        return self._key_bytes

    @property
    def block_bytes(self) -> int:
        return self._ns.block_bytes

    @property
    def max_keys_per_call(self) -> int:
        return self._max_keys

    @property
    def lease_ttl_seconds(self) -> float:
        return self._lease_ttl

    @property
    def transport(self) -> str:
        """The byte path in use now: "shm" or "stream"."""
        return "shm" if self._mapping is not None else "stream"

    @property
    def arena_id(self) -> Optional[bytes]:
        """The id of the arena this client has mapped (None: streaming). Block
        refs from another process's Match are only meaningful in the same arena."""
        m = self._mapping
        return m.arena_id if m is not None else None

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- session

    async def _register(self) -> pb.RegisterSessionResponse:
        req = pb.RegisterSessionRequest(instance_id=self._instance_id, namespace=self._ns)
        try:
            return await call_with_retry(
                lambda: self._stub.RegisterSession(req, timeout=self._timeout,
                                                   metadata=self._metadata),
                max_retries=self._max_retries)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "RegisterSession") from e

    def _apply_registration(self, resp: pb.RegisterSessionResponse, initial: bool) -> None:
        if not resp.session_id:
            raise protocol_error("RegisterSession returned no session id")
        self._session_id = resp.session_id
        self._namespace_id = resp.namespace_id
        self._lease_ttl = resp.lease_ttl_seconds
        self._key_bytes = resp.key_bytes
        self._max_keys = resp.max_keys_per_call
        self._max_message_bytes = resp.max_message_bytes
        self._update_mapping(resp.arena if resp.HasField("arena") else None,
                             strict=initial and self._mode == "shm")

    def _update_mapping(self, arena: Optional[pb.ShmArena], strict: bool) -> None:
        """Map the arena the daemon announced, keeping the current mapping if
        it is the same arena; None (stream) where it cannot be mapped."""
        if self._mode == "stream":
            return
        old, new = self._mapping, None
        if arena is not None and arena.path:
            if (old is not None and old.path == arena.path
                    and old.arena_id == bytes(arena.arena_id) and old.still_valid()):
                return
            from .shm import ShmMapping  # deferred: stream-only clients never touch mmap

            new = ShmMapping.attach(arena.path, arena.size_bytes, bytes(arena.arena_id))
        if old is not None:
            old.close()
        self._mapping = new
        if new is None:
            where = repr(arena.path) if arena is not None and arena.path else "no arena announced"
            if strict:
                raise FailedPreconditionError(
                    f"transport='shm' but the daemon's arena cannot be mapped ({where}); "
                    "is the client on the daemon's host with access to /dev/shm? "
                    "Use transport='auto' to fall back to streaming",
                    grpc.StatusCode.FAILED_PRECONDITION)
            log.info("kvkeeper: shared memory not available (%s); streaming blocks", where)

    async def _reregister(self, stale_session_id: str) -> str:
        """Register again unless another task already replaced `stale_session_id`."""
        async with self._register_lock:
            if self._session_id != stale_session_id:
                return self._session_id
            self._apply_registration(await self._register(), initial=False)
            log.warning("kvkeeper: session %s lost (daemon restarted or lease expired); "
                        "registered again as %s", stale_session_id, self._session_id)
            return self._session_id

    async def renew(self) -> None:
        """Heartbeat now, and register again if the daemon lost the session (it
        restarted, or the session expired). Raises what the daemon answered
        otherwise, e.g. UnavailableError while it is down."""
        sid = self._session_id
        try:
            resp = await self._unary("Heartbeat", lambda s: pb.HeartbeatRequest(session_id=s),
                                     retry=True, rebind=False)
        except KVKeeperClientError as e:
            if not is_session_lost(e):
                raise
            await self._reregister(sid)
            return
        if resp.lease_ttl_seconds > 0:
            self._lease_ttl = resp.lease_ttl_seconds

    async def _heartbeat_loop(self) -> None:
        """renew() every TTL/3. Never raises: failures are logged (the next
        heartbeat, or a call, tries again)."""
        while True:
            ttl = self._lease_ttl
            await asyncio.sleep(max(0.05, ttl / 3.0) if ttl > 0 else 10.0)
            try:
                await self.renew()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                log.warning("kvkeeper: heartbeat failed: %s", e)

    # ---- calls

    def _check_open(self) -> None:
        if self._closed:
            raise RuntimeError("the kvkeeper client is closed")

    async def _unary_sid(self, rpc: str, build: Callable[[str], Any], *, retry: bool,
                         rebind: bool) -> Tuple[Any, str]:
        """Call a unary RPC with the deadline, retrying it on UNAVAILABLE when
        `retry`, and once more in a new session when the daemon lost ours and
        `rebind` (the request carries no id of the old session). Returns the
        response and the session id the request was made with."""
        self._check_open()
        method = getattr(self._stub, rpc)
        sid = self._session_id
        rebound = False
        while True:
            req = build(sid)
            try:
                resp = await call_with_retry(lambda: method(req, timeout=self._timeout,
                                                            metadata=self._metadata),
                                             max_retries=self._max_retries if retry else 0)
                return resp, sid
            except grpc.RpcError as e:
                if rebind and not rebound and is_session_lost(e):
                    sid = await self._reregister(sid)
                    rebound = True
                    continue
                raise from_rpc_error(e, rpc) from e

    async def _unary(self, rpc: str, build: Callable[[str], Any], *, retry: bool,
                     rebind: bool) -> Any:
        return (await self._unary_sid(rpc, build, retry=retry, rebind=rebind))[0]

    def _live_mapping(self) -> Any:
        """The mapping if the arena file is still the daemon's, else None (and
        stream from now on, until a re-registration announces a new arena)."""
        m = self._mapping
        if m is None:
            return None
        if m.still_valid():
            return m
        log.warning("kvkeeper: arena %s changed under the mapping; streaming blocks", m.path)
        self._mapping = None
        m.close()
        return None

    def _check_keys(self, keys: Sequence[bytes]) -> List[bytes]:
        kb = self._key_bytes
        # Fast path, C-level passes only: a list of bytes of the right length.
        if (type(keys) is list and set(map(type, keys)) <= {bytes}
                and (not kb or set(map(len, keys)) <= {kb})):
            return keys
        out = [bytes(k) for k in keys]
        if kb:
            for i, k in enumerate(out):
                if len(k) != kb:
                    raise ValueError(f"key {i} has {len(k)} bytes; the daemon expects {kb}")
        return out

    def _block_views(self, blocks: Sequence[Any], writable: bool) -> List[memoryview]:
        bb = self._ns.block_bytes
        views = []
        for i, b in enumerate(blocks):
            try:
                v = byte_view(b, writable=writable)
            except ValueError as e:
                raise ValueError(f"block {i}: {e}") from None
            if writable and v.nbytes >= bb:
                v = v[:bb]
            if v.nbytes != bb:
                raise ValueError(f"block {i} has {v.nbytes} bytes; the namespace's block_bytes "
                                 f"is {bb}")
            views.append(v)
        return views

    async def _checksums(self, algos: Sequence[int], bufs: Sequence[Any]) -> List[Optional[int]]:
        """Checksum of bufs[i] with algos[i] (None where the algo is unknown here)."""
        def run() -> List[Optional[int]]:
            return [ALGOS[a](b) if a in ALGOS else None for a, b in zip(algos, bufs)]

        total = sum(byte_view(b).nbytes for a, b in zip(algos, bufs) if a in ALGOS)
        return await asyncio.to_thread(run) if total >= _OFFLOAD_BYTES else run()

    async def _verify(self, expected: Sequence[Tuple[int, int]], bufs: Sequence[Any]) -> None:
        """Raise ChecksumError listing the blocks whose checksum differs."""
        if self._checksum_algo == pb.CHECKSUM_NONE:
            return
        got = await self._checksums([a for a, _ in expected], bufs)
        bad = [i for i, ((_, want), have) in enumerate(zip(expected, got))
               if have is not None and have != want]
        if bad:
            raise ChecksumError(bad)

    # ---- API

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
        if blocks and not lease:
            raise ValueError("blocks=True needs lease=True: block extents are only "
                             "valid while a lease pins them")
        keys = self._check_keys(keys)
        if not keys:
            return MatchResult(0, [], None)
        limit = self._max_keys or len(keys)
        if lease:
            keys = keys[:limit]
        ask = blocks and self._mapping is not None
        matched, tiers, lease_id = 0, [], None
        refs: List[pb.BlockRef] = []
        for start in range(0, len(keys), limit):
            part = keys[start:start + limit]
            resp = await self._unary(
                "Match",
                lambda s: pb.MatchRequest(session_id=s, keys=part, lease=lease, blocks=ask,
                                          report_use=report_use),
                retry=not lease, rebind=True)
            matched += resp.matched
            tiers.extend(resp.tiers)
            if lease and resp.lease_id:
                lease_id = resp.lease_id
                if ask:
                    refs = await self._leased_refs(resp)
            if resp.matched < len(part):
                break
        return MatchResult(matched, tiers, lease_id, refs)

    async def _leased_refs(self, resp: pb.MatchResponse) -> List[pb.BlockRef]:
        """The BlockRefs of the lease a Match(blocks=true) granted. On any
        failure the lease is released, since the caller never learns its id."""
        try:
            refs = list(resp.blocks)
            if not refs:
                # A daemon older than MatchRequest.blocks ignores it: Load as before.
                loaded = await self._unary(
                    "Load", lambda s: pb.LoadRequest(session_id=s, lease_id=resp.lease_id),
                    retry=True, rebind=False)
                refs = list(loaded.blocks)
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

    def arena_views(self, refs: Sequence[pb.BlockRef]) -> Optional[List[List[memoryview]]]:
        """Zero-copy views of blocks in the mapped arena: for each BlockRef (from
        MatchResult.blocks), read-only memoryviews of its extents, in order;
        together they hold block_bytes bytes. None when no arena is mapped
        (streaming client, arena gone, client closed): use `load_into` then.

        The views are valid only while the lease is held: after `release` the
        pages may be evicted and reused for other blocks. Read-only because
        the pages are shared with every other reader of the block. A mapping
        closed meanwhile stays mapped until the views are dropped (see
        arena_format.unmap). Checksums are not verified here (that would read
        every byte); each ref carries checksum_algo and checksum for a caller
        that checks its own copy, as `load_into` does.

        Synchronous and safe from any thread: it only reads the mapping.
        """
        m = self._mapping
        if m is None:
            return None
        bb = self._ns.block_bytes
        for i, ref in enumerate(refs):
            length = sum(e.length for e in ref.extents)
            if length != bb:
                raise protocol_error(f"block ref {i} spans {length} bytes, not {bb}")
        try:
            if not m.still_valid():
                return None
            return [[v.toreadonly() for v in m.gather(ref.extents)] for ref in refs]
        except ValueError as e:
            # Another thread (Client's event loop) may close the mapping meanwhile.
            if m.closed:
                return None
            raise protocol_error(f"block ref outside the arena: {e}") from None

    async def load(self, lease_id: int) -> List[bytes]:
        """The bytes of every block of the lease, in lease order."""
        m = self._live_mapping()
        if m is not None:
            resp = await self._unary("Load", lambda s: pb.LoadRequest(session_id=s, lease_id=lease_id),
                                     retry=True, rebind=False)
            if m is self._mapping and m.still_valid():
                blocks = [m.read(ref.extents) for ref in resp.blocks]
                await self._verify([(r.checksum_algo, r.checksum) for r in resp.blocks], blocks)
                return blocks
        return await self._load_stream(lease_id, None)

    async def load_into(self, lease_id: int, outs: Sequence[Any]) -> None:
        """Copy the lease's blocks into `outs` (writable C-contiguous buffers of
        at least block_bytes each, one per leased block, in lease order).
        On ChecksumError every buffer is filled; the bad ones are listed."""
        views = self._block_views(outs, writable=True)
        m = self._live_mapping()
        if m is not None:
            resp = await self._unary("Load", lambda s: pb.LoadRequest(session_id=s, lease_id=lease_id),
                                     retry=True, rebind=False)
            if len(resp.blocks) != len(views):
                raise ValueError(f"lease {lease_id} holds {len(resp.blocks)} blocks but "
                                 f"{len(views)} buffers were given")
            if m is self._mapping and m.still_valid():
                bb = self._ns.block_bytes
                for i, (ref, v) in enumerate(zip(resp.blocks, views)):
                    length = sum(e.length for e in ref.extents)
                    if length != bb:
                        raise protocol_error(f"block {i} of lease {lease_id} spans {length} "
                                              f"bytes, not {bb}")
                    m.read_into(ref.extents, v)
                await self._verify([(r.checksum_algo, r.checksum) for r in resp.blocks], views)
                return
        await self._load_stream(lease_id, views)

    async def load_chunks(self, lease_id: int,
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
        here, and the stream is not retried (load_into does both)."""
        self._check_open()
        cov = Coverage(lease_id, self._ns.block_bytes, max_blocks)
        req = pb.LoadRequest(session_id=self._session_id, lease_id=lease_id)
        try:
            call = self._load_stream_rpc(req, timeout=self._timeout, metadata=self._metadata)
            async for ch in chunks(call, cov):
                yield ch
        except grpc.RpcError as e:
            raise from_rpc_error(e, "LoadStream") from e
        cov.finish()

    async def _load_stream(self, lease_id: int, views: Optional[List[memoryview]]) -> List[bytes]:
        """LoadStream, assembled into `views` (load_into) or into new bytes (load).
        The stream is read-only, so a whole stream is retried on UNAVAILABLE."""
        self._check_open()
        bb = self._ns.block_bytes
        req = pb.LoadRequest(session_id=self._session_id, lease_id=lease_id)

        async def attempt() -> Tuple[Coverage, dict]:
            cov = Coverage(lease_id, bb, len(views) if views is not None else None)
            parts: dict = {}    # index -> [(offset, data)], for load()
            call = self._load_stream_rpc(req, timeout=self._timeout, metadata=self._metadata)
            async for ch in chunks(call, cov):
                if views is not None:
                    views[ch.index][ch.offset:ch.offset + ch.data.nbytes] = ch.data
                else:
                    parts.setdefault(ch.index, []).append((ch.offset, ch.data))
            return cov, parts

        try:
            cov, parts = await call_with_retry(attempt, max_retries=self._max_retries)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "LoadStream") from e
        sums = cov.finish()
        n = len(sums)
        if views is not None:
            if n != len(views):
                raise ValueError(f"lease {lease_id} holds {n} blocks but {len(views)} buffers "
                                 "were given")
            bufs: List[Any] = views
            out: List[bytes] = []
        else:
            out = [b"".join(d for _, d in sorted(parts[i], key=lambda p: p[0]))
                   for i in range(n)]
            bufs = out
        await self._verify(sums, bufs)
        return out

    async def save(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> SaveResult:
        """Store blocks[i] under keys[i]: reserve, write the reserved ones,
        commit. Keys the daemon already has or another writer holds are
        skipped. Lists longer than max_keys_per_call go in several rounds; on
        an error, rounds already committed stay committed."""
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        keys = self._check_keys(keys)
        views = self._block_views(blocks, writable=False)
        self._check_open()
        totals = [0, 0, 0, 0]
        limit = self._max_keys or max(1, len(keys))
        for start in range(0, len(keys), limit):
            r = await self._save_part(keys[start:start + limit], views[start:start + limit])
            for i, v in enumerate((r.reserved, r.present, r.in_flight, r.committed)):
                totals[i] += v
        return SaveResult(*totals)

    async def _save_part(self, keys: List[bytes], views: List[memoryview]) -> SaveResult:
        for _ in range(2):  # a second round streams if the arena vanished after reserving
            m = self._live_mapping()
            transport = pb.TRANSPORT_SHM if m is not None else pb.TRANSPORT_STREAM
            resp, sid = await self._unary_sid(
                "ReserveSave",
                lambda s: pb.ReserveSaveRequest(session_id=s, keys=keys, transport=transport),
                retry=False, rebind=True)
            rid = resp.reservation_id
            try:
                if len(resp.slots) != len(keys):
                    raise protocol_error(f"ReserveSave returned {len(resp.slots)} slots for "
                                          f"{len(keys)} keys")
                status = [s.status for s in resp.slots]
                reserved = [i for i, st in enumerate(status) if st == pb.SLOT_RESERVED]
                present = status.count(pb.SLOT_PRESENT)
                in_flight = status.count(pb.SLOT_IN_FLIGHT)
                if not rid:
                    if reserved:
                        raise protocol_error("slots reserved without a reservation id")
                    return SaveResult(0, present, in_flight, 0)
                if transport == pb.TRANSPORT_SHM:
                    if m is not self._mapping or not m.still_valid():
                        await self._abort(sid, rid)
                        continue
                    for i in reserved:
                        if not resp.slots[i].extents:
                            raise protocol_error(f"reserved slot {i} has no extents")
                        m.write(resp.slots[i].extents, views[i])
                else:
                    await self._write_stream(sid, rid, [(i, views[i]) for i in reserved])
                commit = pb.CommitSaveRequest(session_id=sid, reservation_id=rid)
                if self._checksum_algo != pb.CHECKSUM_NONE:
                    algo = self._checksum_algo
                    sums = await self._checksums([algo] * len(reserved), [views[i] for i in reserved])
                    per_key = [0] * len(keys)
                    for i, c in zip(reserved, sums):
                        per_key[i] = c or 0
                    commit.checksum_algo = algo
                    commit.checksums.extend(per_key)
                cresp = await self._unary("CommitSave", lambda s: commit, retry=False,
                                          rebind=False)
            except BaseException:
                if rid:
                    await self._abort(sid, rid)
                raise
            return SaveResult(len(reserved), present, in_flight, cresp.committed)
        raise KVKeeperClientError("the shared-memory arena changed twice during one save; "
                                  "nothing was written", grpc.StatusCode.ABORTED)

    async def _write_stream(self, sid: str, rid: int, items: List[Tuple[int, memoryview]]) -> None:
        """WriteBlocks: the reserved blocks in chunks of at most 1 MiB (less if
        the daemon's max message size asks for it)."""
        if not items:
            return
        chunk = WRITE_CHUNK_BYTES
        if self._max_message_bytes:
            chunk = max(4096, min(chunk, self._max_message_bytes - 4096))
        try:
            await self._write_blocks_rpc(write_frames(sid, rid, items, chunk),
                                         timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "WriteBlocks") from e

    async def _abort(self, sid: str, rid: int) -> None:
        """AbortSave, best effort: the reservation times out on its own anyway."""
        try:
            await self._unary("AbortSave",
                              lambda s: pb.AbortSaveRequest(session_id=sid, reservation_id=rid),
                              retry=True, rebind=False)
        except Exception as e:
            log.debug("kvkeeper: AbortSave of reservation %d failed: %s", rid, e)

    async def release(self, lease_id: int, discard: bool = False,
                      discard_indices: Sequence[int] = (),
                      report: Optional[Mapping[str, int]] = None) -> None:
        """Unpin the lease's blocks. discard=True also drops every block of the
        lease nobody else references; discard_indices drops just those lease
        positions (e.g. ChecksumError.bad_indices). report: the fields of a
        LookupReport (prompt_tokens, prompt_blocks, local_blocks,
        loaded_blocks) for a lookup made with report_use; lease_id may be 0."""
        def build(s: str) -> pb.ReleaseRequest:
            return pb.ReleaseRequest(session_id=s, lease_id=lease_id, discard=discard,
                                     discard_indices=list(discard_indices),
                                     report=None if report is None else pb.LookupReport(**report))

        await self._unary("Release", build, retry=True, rebind=False)

    async def narrow(self, lease_id: int, start: int, count: int) -> None:
        """Unpin the lease's blocks outside positions [start, start + count); the
        lease keeps the rest, at positions 0..count-1."""
        await self._unary("Release", lambda s: pb.ReleaseRequest(
            session_id=s, lease_id=lease_id, keep_start=start, keep_blocks=count),
            retry=True, rebind=False)

    async def stats(self) -> pb.StatsResponse:
        """The daemon's counters (tiers, sessions, leases, hits...)."""
        return await self._unary("Stats", lambda s: pb.StatsRequest(), retry=True, rebind=False)

    async def health(self, service: str = "") -> str:
        """grpc.health.v1 status name: "SERVING", "NOT_SERVING", "SERVICE_UNKNOWN"
        or "UNKNOWN". Not retried: a probe should report the present."""
        self._check_open()
        try:
            resp = await self._health.Check(health_pb2.HealthCheckRequest(service=service),
                                            timeout=self._timeout)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "Health.Check") from e
        return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)
