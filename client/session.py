"""One session with the daemon: registration, heartbeats, and the unary calls made in it.

The session is kept alive by a heartbeat task (every lease TTL / 3) and
registered again when the daemon restarted or the session expired. A watch
task holds a WatchSession call open beside it (watch.py): when this process
dies, the daemon sees that call end and frees the session's leases at once. Unary
calls get the client's deadline, are retried on UNAVAILABLE when idempotent
(retry.py), and, when they carry no id issued to the old session, are made
once more in the new one. Calls that carry such an id (lease, reservation)
are never replayed after a re-registration: the daemon released them with
that session, and the caller must match again. When the daemon refuses to
register again (refusal.py), the refusal is remembered: until its backoff
passes, calls that would register again raise it without a round trip.

Each registration may announce another arena; `on_arena` (the transport
choice, transport.py) is told, so the byte path follows the daemon.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Awaitable, Callable, Mapping, Optional, Tuple, Union

import grpc

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc
from kvkeeper.v1 import residency_pb2_grpc as rpb_grpc

from .errors import KVKeeperClientError, from_rpc_error, is_session_lost, protocol_error
from .match_lane import AsyncMatchLane
from .refusal import Refusal
from .retry import call_with_retry
from .watch import hold_watch
from .wire import parse_match_response

__all__ = ["Session", "Metadata", "NamespaceLike", "namespace_descriptor"]

log = logging.getLogger(__name__)

MATCH_METHOD = "/kvkeeper.v1.KVKeeper/Match"

NamespaceLike = Union[Mapping[str, Any], pb.NamespaceDescriptor]
Metadata = Optional[Tuple[Tuple[str, str], ...]]  # gRPC call metadata: the bearer token


def namespace_descriptor(ns: NamespaceLike) -> pb.NamespaceDescriptor:
    """A copy of `ns` (a dict of NamespaceDescriptor fields, or one) as a
    NamespaceDescriptor; ValueError if it is not one or has no block size."""
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


class Session:
    """A registered session on `channel`. The registration's fields (id,
    namespace_id, lease_ttl, key_bytes, max_keys, max_message_bytes) are
    read-only for callers: only a (re-)registration changes them.

    on_arena(arena or None, initial): called with what each registration
    announced, before the session is used; it may raise to fail an initial one.
    lane: where Match goes first (match_lane.py), gRPC where it cannot.
    """

    def __init__(self, channel: grpc.aio.Channel, namespace: pb.NamespaceDescriptor, *,
                 instance_id: str, timeout: float, max_retries: int, metadata: Metadata,
                 on_arena: Callable[[Optional[pb.ShmArena], bool], None],
                 lane: Optional[AsyncMatchLane] = None) -> None:
        self.channel = channel
        self.stub = pb_grpc.KVKeeperStub(channel)
        # Match's messages by hand (wire.py): the request goes as built, the
        # answer comes back as a wire.MatchReply.
        match = channel.unary_unary(
            MATCH_METHOD, request_serializer=None, response_deserializer=parse_match_response)
        self.lane = lane
        self._methods = {"Match": match if lane is None else lane_first(lane, match),
            # The residency service's session-scoped call (residency.proto).
            "ReportResidency": rpb_grpc.KVKeeperResidencyStub(channel).ReportResidency}
        self.namespace = namespace
        self.timeout = timeout
        self.max_retries = max_retries
        self.metadata = metadata  # the bearer token, if any
        self.id = ""
        self.namespace_id = b""
        self.lease_ttl = 0.0
        self.key_bytes = 0
        self.max_keys = 0
        self.max_message_bytes = 0
        self.closed = False
        self._instance_id = instance_id
        self._on_arena = on_arena
        self._register_lock = asyncio.Lock()
        self.refusal = Refusal()     # the daemon's last refusal to register again
        self._heartbeat_task: Optional[asyncio.Task] = None
        self._watch_task: Optional[asyncio.Task] = None

    # ---- registration

    async def register(self, initial: bool) -> None:
        """RegisterSession (retried on UNAVAILABLE), and take its answer."""
        req = pb.RegisterSessionRequest(instance_id=self._instance_id, namespace=self.namespace)
        try:
            resp = await call_with_retry(
                lambda: self.stub.RegisterSession(req, timeout=self.timeout,
                                                  metadata=self.metadata),
                max_retries=self.max_retries)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "RegisterSession") from e
        if not resp.session_id:
            raise protocol_error("RegisterSession returned no session id")
        self.id = resp.session_id
        self.namespace_id = resp.namespace_id
        self.lease_ttl = resp.lease_ttl_seconds
        self.key_bytes = resp.key_bytes
        self.max_keys = resp.max_keys_per_call
        self.max_message_bytes = resp.max_message_bytes
        self._on_arena(resp.arena if resp.HasField("arena") else None, initial)

    async def reregister(self, stale_session_id: str) -> str:
        """Register again unless another task already replaced `stale_session_id`.
        While the daemon's last refusal holds (refusal.py), or when it refused
        while this task waited for the lock, raise that refusal without asking."""
        seen = self.refusal.count
        async with self._register_lock:
            if self.id != stale_session_id:
                return self.id
            if self.refusal.count != seen and self.refusal.error is not None:
                raise self.refusal.replay()     # asked just now, for this same id
            self.refusal.check()
            try:
                await self.register(initial=False)
            except KVKeeperClientError as e:
                self.refusal.record(e)
                raise
            refused = self.refusal.clear()
            log.warning("kvkeeper: session %s lost (daemon restarted or lease expired); "
                        "registered again as %s%s", stale_session_id, self.id,
                        " (after the daemon refused)" if refused else "")
            return self.id

    async def renew(self) -> None:
        """Heartbeat now, and register again if the daemon lost the session (it
        restarted, or the session expired). Raises what the daemon answered
        otherwise, e.g. UnavailableError while it is down."""
        sid = self.id
        try:
            resp = await self.unary("Heartbeat", lambda s: pb.HeartbeatRequest(session_id=s),
                                    retry=True, rebind=False)
        except KVKeeperClientError as e:
            if not is_session_lost(e):
                raise
            await self.reregister(sid)
            return
        if resp.lease_ttl_seconds > 0:
            self.lease_ttl = resp.lease_ttl_seconds

    # ---- heartbeats

    def start_heartbeats(self) -> None:
        """Start the heartbeat and watch tasks on the running loop (once registered)."""
        self._heartbeat_task = asyncio.create_task(self._heartbeat_loop(),
                                                   name=f"kvkeeper-heartbeat-{self.id}")
        self._watch_task = asyncio.create_task(hold_watch(self),
                                               name=f"kvkeeper-watch-{self.id}")

    async def _heartbeat_loop(self) -> None:
        """renew() every TTL/3. Never raises: failures are logged (the next
        heartbeat, or a call, tries again): a WARNING when they start or their
        code changes, DEBUG while the same one repeats (a refusal can last
        hours), and one INFO when heartbeats succeed again."""
        failing: Optional[object] = None     # the code of the failure going on, if any
        while True:
            ttl = self.lease_ttl
            await asyncio.sleep(max(0.05, ttl / 3.0) if ttl > 0 else 10.0)
            try:
                await self.renew()
            except asyncio.CancelledError:
                raise
            except Exception as e:
                code = (e.code if isinstance(e, KVKeeperClientError) else None) \
                    or type(e).__name__
                log.log(logging.DEBUG if code == failing else logging.WARNING,
                        "kvkeeper: heartbeat failed: %s", e)
                failing = code
                continue
            if failing is not None:
                log.info("kvkeeper: heartbeats succeed again (session %s)", self.id)
                failing = None

    async def close(self, timeout: Optional[float] = None) -> None:
        """Stop heartbeats and close the session (best effort, within `timeout`
        seconds: by default the deadline); the daemon releases its leases and
        reservations. Calls refuse from here on. The channel stays open."""
        self.closed = True
        await _stop(self._heartbeat_task)
        self._heartbeat_task = None
        try:
            if self.id:
                await self.stub.CloseSession(pb.CloseSessionRequest(session_id=self.id),
                                             timeout=timeout or self.timeout,
                                             metadata=self.metadata)
        except Exception as e:  # the daemon expires the session by itself
            log.debug("CloseSession failed: %s", e)
        finally:
            # After CloseSession: a watch ended first would have the daemon end the
            # session as disconnected (it frees the leases the same, but says so).
            await _stop(self._watch_task)
            self._watch_task = None
            if self.lane is not None:
                self.lane.close()

    # ---- calls

    def check_open(self) -> None:
        if self.closed:
            raise RuntimeError("the kvkeeper client is closed")

    async def unary_sid(self, rpc: str, build: Callable[[str], Any], *, retry: bool,
                        rebind: bool) -> Tuple[Any, str]:
        """Call a unary RPC with the deadline, retrying it on UNAVAILABLE when
        `retry`, and once more in a new session when the daemon lost ours and
        `rebind` (the request carries no id of the old session). Returns the
        response and the session id the request was made with."""
        self.check_open()
        if rebind and self.refusal.holds():
            # Our id is one the daemon lost, and registering again was refused:
            # the call would fail and register again, so say so without asking.
            raise self.refusal.replay()
        method = self._methods.get(rpc) or getattr(self.stub, rpc)
        sid = self.id
        rebound = False
        while True:
            req = build(sid)
            try:
                resp = await call_with_retry(lambda: method(req, timeout=self.timeout,
                                                            metadata=self.metadata),
                                             max_retries=self.max_retries if retry else 0)
                return resp, sid
            except grpc.RpcError as e:
                if rebind and not rebound and is_session_lost(e):
                    sid = await self.reregister(sid)
                    rebound = True
                    continue
                raise from_rpc_error(e, rpc) from e

    async def unary(self, rpc: str, build: Callable[[str], Any], *, retry: bool,
                    rebind: bool) -> Any:
        """unary_sid's response alone."""
        return (await self.unary_sid(rpc, build, retry=retry, rebind=rebind))[0]


def lane_first(lane: AsyncMatchLane, match: Any) -> Callable[..., Awaitable[Any]]:
    """A stand-in for the Match multi-callable `match` that asks on `lane`,
    and over gRPC where the lane cannot be used (none there, or its
    connection broke before the request was sent: see MatchLane.call). A
    status the lane answers is a grpc.RpcError, so retries, re-registration
    and error mapping treat it as the same call's over gRPC."""
    async def call(req: bytes, timeout: float, metadata: Metadata) -> Any:
        # unary_sid, the one caller, always passes the session's deadline.
        got = await lane.call(req, timeout)
        if got is None:
            return await match(req, timeout=timeout, metadata=metadata)
        return parse_match_response(got)
    return call


async def _stop(task: Optional[asyncio.Task]) -> None:
    """Cancel `task` and wait for it to end, whatever it raises."""
    if task is None:
        return
    task.cancel()
    try:
        await task
    except (asyncio.CancelledError, Exception):
        pass
