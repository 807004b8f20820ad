"""Blocking client: the asyncio client run on a private event loop thread.

vLLM's connector hooks are synchronous and run on several threads, so this
wraps AsyncClient instead of duplicating it: one daemon thread owns an event
loop, the channel and the heartbeat task; every method hands a coroutine to
that loop (asyncio.run_coroutine_threadsafe) and waits for it. Heartbeats
therefore keep running while the caller's threads are busy, and any number of
threads may call at once. The exceptions, the connector's calls per request,
run in the calling thread on a blocking channel of the client's own to the
same daemon: `load_chunks` (its streamed load), a leased `match` (its
lookup: a thread hop each way cost as much as the RPC), `release` and
`narrow`.

Each wait is bounded (`call_timeout`, by default enough for every RPC of the
call to use its deadline and all its retries); past it the call is cancelled
and DeadlineExceededError is raised.
"""
from __future__ import annotations

import asyncio
import math
import threading
from typing import Any, Coroutine, Iterator, List, Mapping, Optional, Sequence, TypeVar

import grpc

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

from .aio import CHANNEL_OPTIONS, AsyncClient
from .auth import TLSLike, bearer_metadata, sync_channel
from .checksum import DEFAULT as DEFAULT_CHECKSUM
from .checks import check_keys
from .errors import from_rpc_error, is_session_lost, protocol_error
from .leases import MatchResult
from .match_lane import lane_for
from .saves import SaveResult
from .session import MATCH_METHOD, NamespaceLike
from .stream import (KEYED_UNKNOWN, Coverage, KeyedStream, check_head, keyed_request,
                     load_request, load_stream_method)
from .url import to_grpc_target
from .waits import budget_for, submit, wait_result
from .wire import Chunk, encode_match_request, parse_match_response

HEALTH_CHECK = "/grpc.health.v1.Health/Check"

__all__ = ["Client"]

T = TypeVar("T")


def _run_loop(loop: asyncio.AbstractEventLoop) -> None:
    asyncio.set_event_loop(loop)
    try:
        loop.run_forever()
    finally:
        try:
            pending = [t for t in asyncio.all_tasks(loop) if not t.done()]
            for t in pending:
                t.cancel()
            if pending:
                loop.run_until_complete(asyncio.gather(*pending, return_exceptions=True))
            loop.run_until_complete(loop.shutdown_asyncgens())
        finally:
            loop.close()


class Client:
    """A blocking session with the daemon. Create with `Client.connect(...)`;
    the methods mirror AsyncClient's."""

    def __init__(self, loop: asyncio.AbstractEventLoop, thread: threading.Thread,
                 aclient: AsyncClient, timeout: float, max_retries: int,
                 call_timeout: Optional[float], target: str = "", tls: TLSLike = None,
                 token: Optional[str] = None, match_lane: bool = True) -> None:
        self._loop = loop
        self._thread = thread
        self._aclient = aclient
        self._timeout = timeout
        self._max_retries = max_retries
        self._call_timeout = call_timeout
        self._close_lock = threading.Lock()
        self._closed = False
        # load_chunks' blocking channel, to the same daemon with the same credentials
        self._target, self._tls = target, tls
        self._metadata = bearer_metadata(token)
        self._sync_channel: Optional[grpc.Channel] = None
        self._sync_match: Optional[Any] = None   # Match on it (_match_here)
        self._sync_release: Optional[Any] = None   # Release on it (_release_here)
        # leased Matches, gRPC's stand-in
        self.lane = lane_for(target, tls, token) if match_lane else None

    # ---- lifecycle

    @classmethod
    def connect(cls, url: str, namespace: NamespaceLike, *, instance_id: str = "",
                timeout: float = 5.0, transport: str = "auto",
                checksum: str = DEFAULT_CHECKSUM, max_retries: int = 5, call_timeout: Optional[float] = None,
                token: Optional[str] = None, tls: TLSLike = None,
                copy_threads: int = 0, match_lane: bool = True) -> "Client":
        """Start the loop thread and connect there (see AsyncClient.connect).

        call_timeout: the most seconds one method may block; None derives it
        from timeout and max_retries and the number of RPCs the call makes.
        """
        loop = asyncio.new_event_loop()
        thread = threading.Thread(target=_run_loop, args=(loop,), name="kvkeeper-client",
                                  daemon=True)
        thread.start()
        sub = submit(
            AsyncClient.connect(url, namespace, instance_id=instance_id, timeout=timeout,
                                transport=transport, checksum=checksum,
                                max_retries=max_retries, token=token, tls=tls,
                                copy_threads=copy_threads, match_lane=match_lane), loop)
        try:
            budget = call_timeout or budget_for(timeout, max_retries, 2)
            aclient = wait_result(sub, budget, "connect")
        except BaseException:
            loop.call_soon_threadsafe(loop.stop)
            thread.join(5.0)
            raise
        self = cls(loop, thread, aclient, timeout, max_retries, call_timeout,
                   target=to_grpc_target(url), tls=tls, token=token, match_lane=match_lane)
        self._warm_stream_channel()
        return self

    def _warm_stream_channel(self) -> None:
        """Leased Matches (and, streaming, the loads) go on the blocking
        channel: connect it now, not in the first lookup, with one health
        Check on it (any answer has connected it). Not channel_ready_future:
        the connectivity poller it starts outlives the future by up to 0.2 s,
        and a client closed meanwhile left it dying on the closed channel
        ("Cannot monitor channel state: Channel closed!" on stderr)."""
        check = self._stream_channel().unary_unary(
            HEALTH_CHECK, request_serializer=None, response_deserializer=None)
        try:
            check(b"", timeout=self._timeout, metadata=self._metadata)   # service "": the server
        except grpc.RpcError:
            pass   # a warm-up only: the calls that need the channel report their own errors

    def close(self, timeout: Optional[float] = None) -> None:
        """Close the session (CloseSession within `timeout` seconds, by default
        the client's deadline) and stop the loop thread. Idempotent."""
        with self._close_lock:
            if self._closed:
                return
            self._closed = True
        if self.lane is not None:
            self.lane.close()
        if self._sync_channel is not None:
            self._sync_channel.close()
        try:
            self._submit(self._aclient.close(timeout), rpcs=1, check=False)
        finally:
            self._loop.call_soon_threadsafe(self._loop.stop)
            if threading.current_thread() is not self._thread:
                self._thread.join(5.0)

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ---- forwarding

    def _submit(self, coro: Coroutine[Any, Any, T], rpcs: int = 1, check: bool = True) -> T:
        if check and self._closed:
            coro.close()
            raise RuntimeError("the kvkeeper client is closed")
        if threading.current_thread() is self._thread:
            coro.close()
            raise RuntimeError("kvkeeper.client.Client called from its own event loop thread; "
                               "use AsyncClient there")
        budget = self._call_timeout or budget_for(self._timeout, self._max_retries, rpcs)
        return wait_result(submit(coro, self._loop), budget,  # type: ignore[no-any-return]
                           getattr(coro, "__name__", "call"))

    def _rounds(self, n: int) -> int:
        limit = self._aclient.max_keys_per_call
        return max(1, math.ceil(n / limit)) if limit else 1

    # ---- properties (read-only snapshots of the async client's state)

    @property
    def session_id(self) -> str:
        return self._aclient.session_id

    @property
    def namespace(self) -> pb.NamespaceDescriptor:
        return self._aclient.namespace

    @property
    def namespace_id(self) -> bytes:
        return self._aclient.namespace_id

    @property
    def key_bytes(self) -> int:
        return self._aclient.key_bytes

    @property
    def block_bytes(self) -> int:
        return self._aclient.block_bytes

    @property
    def max_keys_per_call(self) -> int:
        return self._aclient.max_keys_per_call

    @property
    def lease_ttl_seconds(self) -> float:
        return self._aclient.lease_ttl_seconds

    @property
    def transport(self) -> str:
        return self._aclient.transport

    @property
    def copy_threads(self) -> int:
        return self._aclient.copy_threads

    @property
    def arena_id(self) -> Optional[bytes]:
        return self._aclient.arena_id

    @property
    def arena_mapping(self) -> Optional[Any]:
        """See AsyncClient.arena_mapping."""
        return self._aclient.arena_mapping

    @property
    def closed(self) -> bool:
        return self._closed

    # ---- API (see AsyncClient for the semantics)

    def match(self, keys: Sequence[bytes], lease: bool = False,
              blocks: bool = False, report_use: bool = False) -> MatchResult:
        if lease and not self._closed and threading.current_thread() is not self._thread:
            res = self._match_here(keys, blocks, report_use)
            if res is not None:
                return res
        # blocks may add a Load (older daemons) and a Release (on failure).
        rpcs = 2 * self._rounds(len(keys)) + (2 if blocks else 0)
        return self._submit(self._aclient.match(keys, lease, blocks, report_use), rpcs=rpcs)

    def _match_here(self, keys: Sequence[bytes], blocks: bool,
                    report_use: bool) -> Optional[MatchResult]:
        """A leased Match (one RPC, never retried, as AsyncClient.match makes
        it) sent from the calling thread, on the match lane where the daemon
        has one (match_lane.py), else on the blocking channel: no hop to
        the event loop thread and back, which cost the connector's lookups
        about as much as the RPC itself on a busy 2-core machine (issue 12).
        None where the async path must do it: the daemon lost the session
        (it registers again there), or granted a lease without the blocks
        asked for (an older daemon: that path Loads them; this lease is
        released first)."""
        ac = self._aclient
        if ac.refused:   # the async path raises the refusal without an RPC
            return None
        kb = ac.key_bytes
        keys = check_keys(keys, kb)
        if not keys:
            return MatchResult(0, [], None)
        keys = keys[:ac.max_keys_per_call or len(keys)]
        ask = blocks and ac.arena_mapping is not None
        req = encode_match_request(ac.session_id, keys, kb, True, ask, report_use)
        try:   # the lane's LaneError is an RpcError too
            got = self.lane.call(req, self._timeout) if self.lane is not None else None
            resp = parse_match_response(got) if got is not None else \
                self._match_rpc()(req, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            if is_session_lost(e):
                return None
            raise from_rpc_error(e, "Match") from e
        if ask and resp.lease_id and len(resp.blocks) != resp.matched:
            self.release(resp.lease_id)
            return None
        return MatchResult(resp.matched, list(resp.tiers), resp.lease_id or None,
                           list(resp.blocks) if ask and resp.lease_id else [])

    def _match_rpc(self) -> Any:
        rpc = self._sync_match
        if rpc is None:
            rpc = self._sync_match = self._stream_channel().unary_unary(
                MATCH_METHOD, request_serializer=None,
                response_deserializer=parse_match_response)
        return rpc

    def arena_views(self, refs: Sequence[Any]) -> Optional[List[List[memoryview]]]:
        # No hop to the loop thread: AsyncClient.arena_views only reads the mapping.
        return self._aclient.arena_views(refs)

    def load(self, lease_id: int) -> List[bytes]:
        return self._submit(self._aclient.load(lease_id), rpcs=2)

    def load_into(self, lease_id: int, outs: Sequence[Any]) -> None:
        self._submit(self._aclient.load_into(lease_id, outs), rpcs=2)

    def load_chunks(self, lease_id: int, max_blocks: Optional[int] = None) -> Iterator[Chunk]:
        """AsyncClient.load_chunks, read in the calling thread on a blocking
        channel of this client's own (opened on first use): each message
        goes from gRPC's threads to the caller without a hop through the
        event loop thread, which costs a wakeup per message (on a busy
        machine, measured as a third of the speed). Stopping early (break,
        an exception) cancels the stream."""
        if self._closed:
            raise RuntimeError("the kvkeeper client is closed")
        call = self._load_stream(load_request(self.session_id, lease_id))
        return self._chunks(call, lease_id, max_blocks)

    def stream_matching(self, keys: Sequence[bytes]) -> Optional[KeyedStream]:
        """Match `keys` under a new report_use lease and stream it, in one call
        on load_chunks' channel (LoadRequest.keys): the lease (0: nothing
        matched), how many keys matched, and its chunks as load_chunks yields
        them. The caller releases the lease. None where the daemon does not
        know the keyed form, or for more keys than one call takes: match and
        load_chunks then."""
        if self._closed:
            raise RuntimeError("the kvkeeper client is closed")
        if len(keys) > self.max_keys_per_call:
            return None
        call = self._load_stream(keyed_request(self.session_id, keys))
        try:
            head = next(call)
        except grpc.RpcError as e:
            call.cancel()
            if e.code() in KEYED_UNKNOWN:
                return None   # an older daemon looked for lease 0
            raise from_rpc_error(e, "LoadStream") from e
        except StopIteration:
            raise protocol_error("a keyed LoadStream ended before naming its lease") from None
        try:
            check_head(head)
        except BaseException:
            call.cancel()
            raise
        if not head.lease_id:
            call.cancel()
            return KeyedStream(0, head.matched, iter(()))
        return KeyedStream(head.lease_id, head.matched, self._chunks(call, head.lease_id, None))

    def _load_stream(self, req: pb.LoadRequest) -> Any:
        return load_stream_method(self._stream_channel())(req, timeout=self._timeout,
                                                          metadata=self._metadata)

    def _chunks(self, call: Any, lease_id: int, max_blocks: Optional[int]) -> Iterator[Chunk]:
        cov = Coverage(lease_id, self.block_bytes, max_blocks)
        try:
            for packed in call:
                yield from cov.take(packed)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "LoadStream") from e
        finally:
            call.cancel()   # no-op once the stream ended; stops it on our errors
        cov.finish()

    def _stream_channel(self) -> grpc.Channel:
        with self._close_lock:
            if self._closed:
                raise RuntimeError("the kvkeeper client is closed")
            if self._sync_channel is None:
                self._sync_channel = sync_channel(self._target, self._tls, CHANNEL_OPTIONS)
            return self._sync_channel

    def save(self, keys: Sequence[bytes], blocks: Sequence[Any],
             parent: Optional[bytes] = None) -> SaveResult:
        return self._submit(self._aclient.save(keys, blocks, parent),
                            rpcs=6 * self._rounds(len(keys)))

    def release(self, lease_id: int, discard: bool = False,
                discard_indices: Sequence[int] = (),
                report: Optional[Mapping[str, int]] = None, last_turn: bool = False) -> None:
        req = pb.ReleaseRequest(session_id=self.session_id, lease_id=lease_id, discard=discard,
                                discard_indices=list(discard_indices),
                                report=None if report is None else pb.LookupReport(**report),
                                last_turn=last_turn)
        if not self._release_here(req):
            self._submit(self._aclient.release(lease_id, discard, discard_indices, report,
                                               last_turn))

    def narrow(self, lease_id: int, start: int, count: int) -> None:
        req = pb.ReleaseRequest(session_id=self.session_id, lease_id=lease_id, keep_start=start,
                                keep_blocks=count)
        if not self._release_here(req):
            self._submit(self._aclient.narrow(lease_id, start, count))

    def _release_here(self, req: pb.ReleaseRequest) -> bool:
        """Release `req` from the calling thread on the blocking channel, as
        _match_here sends the lookup: the connector releases every lease
        right as the engine emits the request's first token, and the event
        loop's share of the call (~0.2 ms of CPU under the GIL) competed with
        that. False where the async path must do it: the client is closed
        (it raises), or UNAVAILABLE (it retries, as for any Release)."""
        if self._closed or threading.current_thread() is self._thread:
            return False
        rpc = self._sync_release
        if rpc is None:
            rpc = self._sync_release = pb_grpc.KVKeeperStub(self._stream_channel()).Release
        try:
            rpc(req, timeout=self._timeout, metadata=self._metadata)
        except grpc.RpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE:
                return False
            raise from_rpc_error(e, "Release") from e
        return True

    def stats(self) -> pb.StatsResponse:
        return self._submit(self._aclient.stats())

    def renew(self) -> None:
        # a Heartbeat, and a RegisterSession when the session was lost
        self._submit(self._aclient.renew(), rpcs=2)

    def health(self, service: str = "") -> str:
        return self._submit(self._aclient.health(service))

    def report_residency(self, changes: Sequence[Any], *, capacity_blocks: int = 0,
                         report_seq: int = 0) -> Any:
        """See AsyncClient.report_residency: (answer, session id it went to)."""
        return self._submit(self._aclient.report_residency(
            changes, capacity_blocks=capacity_blocks, report_seq=report_seq))
