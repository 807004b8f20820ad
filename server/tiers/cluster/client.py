"""The cluster tier's one connection to Redis/Valkey: a `redis` asyncio client
(one server, or redis.asyncio.cluster.RedisCluster) behind a deadline per call.

Every call either answers within `timeout_s` or raises ClusterFault, a
TierError whose `kind` says what went wrong (FAULT_KINDS); each fault is
counted by kind and logged at a bounded rate (ops/ratelog.py). The client
reconnects by itself: redis-py opens a new connection on the next call, the
cluster client refreshes its slot map after a failover. A call that succeeds
after connection faults counts one reconnect and logs that the cluster is
back. No call retries inside redis-py (the deadline would be spent on
retries): the tier's next call is the retry.
"""
from __future__ import annotations

import asyncio
import logging
import ssl
import time
from collections import Counter
from typing import Any, Awaitable, Callable, Optional, Sequence, TypeVar

import redis.asyncio as aredis
from redis import exceptions as rex
from redis.asyncio.cluster import ClusterNode, RedisCluster
from redis.backoff import NoBackoff
from redis.asyncio.retry import Retry

from ...ops.ratelog import RepeatLog
from ..disk import TierError
from .config import ClusterConfigError, ClusterSettings

log = logging.getLogger("kvkeeper.cluster")

T = TypeVar("T")

# What a fault was, as counted and exported (a label value: a short, fixed set).
FAULT_KINDS = ("timeout", "connection", "cluster_down", "loading", "oom", "readonly", "auth",
               "response", "other")
# While the cluster is unreachable, one call a second tries it again; the others
# do not wait for a deadline each: they are misses (or dropped writes) at once.
RETRY_S = 1.0
# The most the background upkeep waits for the cluster to (re)connect and map its slots.
SETTLE_S = 5.0
# Faults that mean the cluster (or a node) is unreachable, not refusing one command.
_DOWN_KINDS = frozenset({"timeout", "connection", "cluster_down", "loading"})
_AUTH_WORDS = ("WRONGPASS", "NOAUTH", "NOPERM", "invalid username-password",
               "Authentication required", "already authenticated")


if hasattr(asyncio, "timeout"):   # 3.11 on: the deadline without a task per call
    async def _within(aw: Awaitable[T], timeout_s: float) -> T:
        async with asyncio.timeout(timeout_s):
            return await aw
else:                              # 3.10: wait_for runs `aw` in a task of its own
    async def _within(aw: Awaitable[T], timeout_s: float) -> T:
        return await asyncio.wait_for(aw, timeout_s)


class ClusterFault(TierError):
    """A cluster call failed or ran past its deadline: a miss or a dropped write."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


def fault_kind(e: BaseException) -> str:
    """Which of FAULT_KINDS an exception from a call is."""
    text = str(e)
    if isinstance(e, (asyncio.TimeoutError, TimeoutError, rex.TimeoutError)):
        return "timeout"
    if isinstance(e, rex.AuthenticationError) or any(w in text for w in _AUTH_WORDS):
        return "auth"
    if isinstance(e, rex.BusyLoadingError) or text.startswith("LOADING"):
        return "loading"
    if isinstance(e, (rex.ClusterDownError, rex.MasterDownError, rex.SlotNotCoveredError,
                      rex.TryAgainError)) or text.startswith(("CLUSTERDOWN", "MASTERDOWN")):
        return "cluster_down"
    if isinstance(e, rex.ReadOnlyError) or text.startswith("READONLY"):
        return "readonly"
    if isinstance(e, rex.OutOfMemoryError) or text.startswith("OOM"):
        return "oom"
    if isinstance(e, (rex.ConnectionError, OSError, rex.RedisClusterException,
                      rex.MaxConnectionsError)):
        return "connection"
    if isinstance(e, rex.ResponseError):
        return "response"
    return "other"


def connection_kwargs(s: ClusterSettings, password: Optional[str]) -> dict[str, Any]:
    """What both kinds of client take: credentials, TLS, timeouts, no retries."""
    kw: dict[str, Any] = dict(
        username=s.username or None, password=password,
        socket_timeout=s.timeout_s, socket_connect_timeout=s.timeout_s,
        retry=Retry(NoBackoff(), 0), max_connections=s.max_connections,
        health_check_interval=0, client_name="kvkeeper")
    if s.url.tls:
        kw.update(ssl=True, ssl_cert_reqs="required", ssl_ca_certs=s.ca_file or None,
                  ssl_certfile=s.cert_file or None, ssl_keyfile=s.key_file or None)
    return kw


def make_redis(s: ClusterSettings, password: Optional[str]) -> Any:
    """A redis.asyncio client for the settings' URL (no connection yet)."""
    kw = connection_kwargs(s, password)
    if s.url.cluster:
        # require_full_coverage=False: while a master fails over, the other
        # masters' slots go on serving; the lost ones are misses meanwhile.
        return RedisCluster(startup_nodes=[ClusterNode(h, p) for h, p in s.url.nodes],
                            require_full_coverage=False, **kw)
    host, port = s.url.nodes[0]
    return aredis.Redis(host=host, port=port, db=s.url.db, **kw)


class ClusterClient:
    """The tier's calls to the cluster, each under the deadline (see the module docstring)."""

    def __init__(self, settings: ClusterSettings, password: Optional[str],
                 log_level: int = logging.WARNING) -> None:
        """`log_level`: of the fault lines (the start-up check's are debug: it
        reports what it finds itself)."""
        self.settings = settings
        self.timeout_s = settings.timeout_s
        self.redis = make_redis(settings, password)
        self.faults: Counter[str] = Counter()
        self.reconnects = 0
        self.up = True           # the last call reached the cluster
        self.skipped = 0         # calls not sent while it was unreachable
        self._tried_at = -1e18
        self._unsettled = True   # see _settled
        self._settling = asyncio.Lock()
        # A call takes at most one connection per node: this many at once fit every pool.
        self._slots = asyncio.Semaphore(settings.max_connections)
        self._logs = {k: RepeatLog(log, f"cluster_{k}", log_level) for k in FAULT_KINDS}

    @property
    def is_cluster(self) -> bool:
        return self.settings.url.cluster

    @property
    def settled(self) -> bool:
        """Whether the last call reached the cluster and (a cluster) its slot map is known."""
        return self.up and not self._unsettled

    async def settle(self) -> None:
        """Connect and learn the slot map now, not on the first lookup's time
        (the tier does it in the background while unsettled); ClusterFault."""
        # Its own, longer deadline: learning the slot map (CLUSTER SLOTS, COMMAND)
        # can take longer than a block's call on a busy host, and cut short it
        # would start over on every try; data calls meanwhile are misses.
        deadline = max(self.timeout_s, SETTLE_S)
        if self.is_cluster:
            await self.call("CLUSTER SLOTS", self.redis.initialize, force=True, timeout_s=deadline)
        else:
            await self.call("PING", self.redis.ping, force=True, timeout_s=deadline)

    async def call(self, what: str, fn: Callable[[], Awaitable[T]], force: bool = False,
                   timeout_s: Optional[float] = None) -> T:
        """`await fn()` within the deadline (`timeout_s`, else the settings');
        ClusterFault (counted, logged) otherwise. While the cluster is
        unreachable only one call per RETRY_S is sent (any with `force`); the
        others raise ClusterFault("unreachable") at once, counted in `skipped`."""
        now = time.monotonic()
        if not (self.up or force) and now - self._tried_at < RETRY_S:
            self.skipped += 1
            raise ClusterFault("unreachable", f"cluster tier: {what} not sent: the cluster is "
                                              f"unreachable (tried again every {RETRY_S:g}s)")
        self._tried_at = now
        try:
            result = await _within(self._settled(fn), timeout_s or self.timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as e:  # noqa: BLE001 - every failure of a call is a fault
            raise self.fault(what, e) from e
        self.ok()
        return result

    async def _settled(self, fn: Callable[[], Awaitable[T]]) -> T:
        """fn(), one call at a time while the cluster client (re)learns the slot
        map: on a fresh client or after the cluster was unreachable. Concurrent
        first calls of redis' RedisCluster break each other's connections
        ("Connection closed by server"). And no more calls at once than
        max_connections: redis' pools refuse the next one (MaxConnectionsError)
        rather than wait. Both waits count in the deadline."""
        async with self._slots:
            if self.is_cluster and self._unsettled:
                async with self._settling:
                    if self._unsettled:   # else another call settled it meanwhile
                        result = await fn()
                        self._unsettled = False
                        return result
            return await fn()

    def fault(self, what: str, e: BaseException) -> ClusterFault:
        """Count and (at a bounded rate) log `e`, met doing `what`; the fault to raise."""
        kind = fault_kind(e)
        self.faults[kind] += 1
        if kind in _DOWN_KINDS:
            self.up = False
            self._unsettled = True
        text = (f"after {self.timeout_s:g}s (cluster_tier.timeout_seconds)" if kind == "timeout"
                else f"{type(e).__name__}: {e}")
        self._logs[kind].log("cluster tier: %s failed (%s): %s", what, kind, text)
        return ClusterFault(kind, f"cluster tier: {what} failed ({kind}): {text}")

    def ok(self) -> None:
        if not self.up:
            self.up = True
            self.reconnects += 1
            log.info("cluster tier: %s reachable again (reconnect %d)",
                     self.settings.url.show(), self.reconnects,
                     extra={"event": "cluster_reconnected"})

    # ------------------------------------------------------------ commands
    async def get(self, key: bytes) -> Optional[bytes]:
        return await self.call("GET", lambda: self.redis.get(key))

    async def set(self, key: bytes, value: Any) -> None:
        await self.call("SET", lambda: self.redis.set(key, value))

    async def delete(self, key: bytes) -> None:
        await self.call("DEL", lambda: self.redis.delete(key))

    async def strlens(self, keys: Sequence[bytes]) -> list[Optional[int]]:
        """STRLEN of each key, pipelined: one round trip per node holding some
        of them. None for a key whose node answered with an error (counted)."""
        async def run() -> list[Any]:
            pipe = (self.redis.pipeline() if self.is_cluster
                    else self.redis.pipeline(transaction=False))
            for k in keys:
                pipe.strlen(k)
            return await pipe.execute(raise_on_error=False)

        out: list[Optional[int]] = []
        for r in await self.call("STRLEN pipeline", run):
            if isinstance(r, BaseException):
                self.fault("STRLEN", r)
                out.append(None)
            else:
                out.append(int(r))
        return out

    async def memory(self) -> tuple[int, int]:
        """(used_memory, maxmemory) summed over the masters; maxmemory 0 on a
        node without a limit counts as 0."""
        async def run() -> list[dict[str, Any]]:
            if self.is_cluster:
                per_node = await self.redis.info("memory", target_nodes=RedisCluster.PRIMARIES)
                return list(per_node.values()) if isinstance(per_node, dict) and \
                    "used_memory" not in per_node else [per_node]
            return [await self.redis.info("memory")]

        infos = await self.call("INFO memory", run)
        return (sum(int(i.get("used_memory", 0)) for i in infos),
                sum(int(i.get("maxmemory", 0)) for i in infos))

    async def ping(self) -> None:
        if self.is_cluster:
            await self.call("PING", lambda: self.redis.ping(target_nodes=RedisCluster.PRIMARIES))
        else:
            await self.call("PING", self.redis.ping)

    async def aclose(self) -> None:
        try:
            await asyncio.wait_for(self.redis.aclose(), self.timeout_s)
        except Exception as e:  # noqa: BLE001 - closing a broken connection is no news
            log.debug("cluster tier: closing the client: %s", e)


# ---------------------------------------------------------------- start-up check

def _ssl_reason(e: BaseException) -> Optional[str]:
    """The SSL error behind a connection failure, as text, or None."""
    seen: set[int] = set()
    cur: Optional[BaseException] = e
    while cur is not None and id(cur) not in seen:
        seen.add(id(cur))
        if isinstance(cur, ssl.SSLError):
            return str(cur)
        cur = cur.__cause__ or cur.__context__
    text = str(e)
    return text if "SSL" in text or "certificate" in text.lower() else None


def startup_error(s: ClusterSettings, e: BaseException) -> Optional[ClusterConfigError]:
    """The configuration error a failed first contact reveals (wrong password,
    TLS that does not match), naming its key; None for a cluster that is only
    down or slow (the daemon starts and the tier serves misses until it is up)."""
    kind = fault_kind(e)
    where = s.url.show()
    if kind == "auth":
        return ClusterConfigError(
            f"{where} refused the credentials (user {s.username or 'default'!r} of "
            f"cluster_tier.username, password from cluster_tier.password_file "
            f"{s.password_file or '(none set)'}): {e}", "cluster_tier.password_file")
    reason = _ssl_reason(e)
    if reason is not None:
        low = reason.lower()
        if "certificate verify failed" in low or "unknown ca" in low:
            key, hint = "cluster_tier.ca_file", "the server's certificate is not signed by it"
        elif "certificate required" in low or "peer did not return a certificate" in low:
            key, hint = "cluster_tier.cert_file", "the server asks for a client certificate"
        elif s.url.tls:
            key, hint = "cluster_tier.url", "is the server speaking TLS on that port?"
        else:
            key, hint = "cluster_tier.url", "the server speaks TLS: write rediss://"
        return ClusterConfigError(f"TLS with {where} failed ({hint}): {reason}", key)
    if not s.url.tls and ("closed by server" in str(e) or "reset by peer" in str(e)):
        return ClusterConfigError(
            f"{where} closed the connection at once: if it only speaks TLS, write rediss:// "
            f"in cluster_tier.url ({e})", "cluster_tier.url")
    return None


async def first_contact(s: ClusterSettings, password: Optional[str]) -> Optional[str]:
    """PING the cluster once with a client of its own. ClusterConfigError for a
    configuration the cluster refuses; else None when it answered, or why it
    could not be reached (the daemon starts anyway)."""
    client = ClusterClient(s, password, log_level=logging.DEBUG)
    try:
        await client.ping()
    except ClusterFault as f:
        cause = f.__cause__ if f.__cause__ is not None else f
        err = startup_error(s, cause)
        if err is None and s.url.tls and f.kind in ("timeout", "connection") and \
                await speaks_plain_resp(*s.url.nodes[0], s.timeout_s):
            err = ClusterConfigError(f"{s.url.show()} answers without TLS (a TLS handshake "
                                     "gets no reply): write redis://", "cluster_tier.url")
        if err is not None:
            raise err from None
        return str(f)
    finally:
        await client.aclose()
    return None


async def speaks_plain_resp(host: str, port: int, timeout_s: float) -> bool:
    """Whether host:port answers a plain-text PING as Redis does (+PONG, or an
    error such as -NOAUTH): how a rediss:// URL that names a plain port shows,
    since there the TLS handshake only waits."""
    try:
        reader, writer = await asyncio.wait_for(asyncio.open_connection(host, port), timeout_s)
    except (OSError, asyncio.TimeoutError):
        return False
    try:
        writer.write(b"PING\r\n")
        first = await asyncio.wait_for(reader.read(1), timeout_s)
        return first in (b"+", b"-")
    except (OSError, asyncio.TimeoutError):
        return False
    finally:
        writer.close()
