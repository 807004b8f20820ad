"""The match lane: a leased Match on a plain unix socket beside the daemon's gRPC one.

Why: the connector's lookup is one leased Match per request, on the time to
first token's critical path. Over gRPC, most of its time is grpc's own
machinery on both sides, not the ledger: a 64-key Match takes about 1.3 ms
on a quiet 2-core machine against 0.1-0.2 ms of the daemon's own work
(issue 12). The lane carries the same protobuf messages in a bare frame, so
what the daemon decides is the one Match handler's, with its errors,
metrics and draining; only the transport differs.

The daemon listens at its socket's path plus LANE_SUFFIX, with the
socket's mode and group (one trust domain, as the arena and the peer
socket), and only without a tokens file: there a call must carry a token,
which stays gRPC's business. The random session id is the capability.

Framing: a 4-byte little-endian length, then that many bytes. A request is
a serialized MatchRequest; an answer is one byte, the gRPC status code's
number (0: OK), then a serialized MatchResponse, or, when not OK, the
status's details in UTF-8. One call at a time per connection, in order.
Both sides import only this module for the format.
"""
from __future__ import annotations

import asyncio
import errno
import os
import socket
import struct
import threading
import time
from typing import Any, Callable, Coroutine, List, Optional, Tuple, TypeVar

import grpc

__all__ = ["LANE_SUFFIX", "LEN", "AsyncMatchLane", "LaneError", "MatchLane", "answer_frame",
           "lane_for", "lane_path", "read_answer"]

LANE_SUFFIX = ".match"
LEN = struct.Struct("<I")
_CODES = {c.value[0]: c for c in grpc.StatusCode}
L = TypeVar("L")

# Seconds the lane stays unused after it could not connect: a daemon without
# one (an older daemon, or one with a tokens file) costs a failed connect
# (microseconds on a unix socket) that often, not every lookup. Short, because
# the same failure is also a daemon being restarted: meanwhile lookups go over
# gRPC, whose channel may sit in its reconnect back-off (1 s, then x1.6 each
# try) well after the new daemon answers, so with a 30 s pause a restarted
# daemon's first lookups could miss for seconds.
RETRY_AFTER_S = 1.0
# Idle connections an AsyncMatchLane keeps: a burst of concurrent calls opens
# one each, and past this many they close as their calls end, so a quiet
# client does not hold a burst's worth of descriptors (and daemon tasks).
MAX_IDLE = 16
# A write that fails with these never reached the daemon whole: it cannot
# have acted on it (EPIPE: it had closed the connection; ENOTCONN: asyncio
# took a connect refused for a full listen queue, EAGAIN on a unix socket,
# as one in progress).
_NOT_SENT = (errno.EPIPE, errno.ENOTCONN)


def lane_path(socket_path: str) -> str:
    """Where the daemon listening on `socket_path` answers the match lane."""
    return socket_path + LANE_SUFFIX


def answer_frame(code: grpc.StatusCode, body: bytes) -> bytes:
    """The frame of an answer: `body` is the response (OK) or the details."""
    return LEN.pack(len(body) + 1) + bytes((code.value[0],)) + body


class LaneError(grpc.RpcError):
    """A status the daemon answered on the lane: read as a gRPC call's error
    (client.errors.from_rpc_error, is_session_lost)."""

    def __init__(self, code: grpc.StatusCode, details: str) -> None:
        super().__init__(f"{code.name}: {details}")
        self._code, self._details = code, details

    def code(self) -> grpc.StatusCode:
        return self._code

    def details(self) -> str:
        return self._details


class MatchLane:
    """Blocking calls on the lane, one connection per calling thread (the
    connector's link threads each have one).

    call() answers None where the lane cannot be used (no socket there, or
    the connection broke before the request was sent whole): the caller then
    asks over gRPC. Once the request is sent, a failure is the call's, as
    for a gRPC call: the daemon may have acted on it."""

    def __init__(self, path: str, *, retry_after_s: float = RETRY_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._local = threading.local()
        self._not_before = 0.0
        self._closed = False
        self.calls = 0   # answered on the lane (tests and benchmarks read it)

    def _socket(self, timeout: float) -> Optional[socket.socket]:
        s: Optional[socket.socket] = getattr(self._local, "sock", None)
        if s is not None and getattr(self._local, "pid", 0) == os.getpid():
            return s
        self._local.sock = None   # none yet, or inherited across a fork: never shared
        if self._closed or self._clock() < self._not_before:
            return None
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.settimeout(timeout)
        try:
            s.connect(self.path)
        except OSError:
            s.close()
            self._not_before = self._clock() + self._retry_after_s
            return None
        self._local.sock, self._local.pid = s, os.getpid()
        return s

    def _drop(self) -> None:
        s, self._local.sock = getattr(self._local, "sock", None), None
        if s is not None:
            s.close()

    def call(self, request: bytes, timeout: float) -> Optional[bytes]:
        """The MatchResponse bytes; LaneError for a status other than OK
        (DEADLINE_EXCEEDED, UNAVAILABLE when the answer never came)."""
        frame = LEN.pack(len(request)) + request
        for _ in range(2):   # a connection to a daemon since restarted, then a new one
            s = self._socket(timeout)
            if s is None:
                return None
            try:
                s.settimeout(timeout)
                s.sendall(frame)
                break
            except OSError:
                self._drop()
            except BaseException:
                # Interrupted (a signal's exception) with part of the frame
                # sent: the daemon would read the next call's as its rest.
                self._drop()
                raise
        else:
            return None
        try:
            head = _recv(s, LEN.size)
            n = LEN.unpack(head)[0]
            body = _recv(s, n) if n else b""
        except socket.timeout:
            self._drop()   # the late answer must not be read as the next call's
            raise LaneError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no answer on the match lane within {timeout:.3f} s") from None
        except OSError as e:
            self._drop()
            raise LaneError(grpc.StatusCode.UNAVAILABLE,
                            f"the match lane closed before answering: {e}") from None
        except BaseException:
            self._drop()   # interrupted: the same, whatever interrupted it
            raise
        resp = read_answer(body)
        self.calls += 1
        return resp

    def close(self) -> None:
        """No new connections; this thread's is closed (the others close
        with their threads' ends or the process's)."""
        self._closed = True
        self._drop()


class AsyncMatchLane:
    """The lane for an asyncio client (AsyncClient's Match, any kind): a pool
    of connections, each carrying one call at a time, so concurrent calls
    never wait for each other's answers. call() as MatchLane.call."""

    def __init__(self, path: str, *, retry_after_s: float = RETRY_AFTER_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.path = path
        self._retry_after_s = retry_after_s
        self._clock = clock
        self._idle: List[Conn] = []
        self._not_before = 0.0
        self._closed = False
        self.calls = 0

    async def _take(self) -> Optional[Conn]:
        while self._idle:
            r, w = self._idle.pop()
            if not (r.at_eof() or w.is_closing()):
                return r, w
            w.close()   # the daemon closed it while it was idle (a restart)
        if self._closed or self._clock() < self._not_before:
            return None
        try:
            r, w = await asyncio.open_unix_connection(self.path)
        except OSError:
            self._not_before = self._clock() + self._retry_after_s
            return None
        try:
            # A full listen queue refuses a unix connect with EAGAIN, which
            # asyncio takes for a connect in progress: it hands back a socket
            # that is not connected. This call goes over gRPC; the lane stays
            # (the burst passes), so no back-off.
            w.get_extra_info("socket").getpeername()
        except OSError:
            w.close()
            return None
        return r, w

    async def call(self, request: bytes, timeout: float) -> Optional[bytes]:
        frame = LEN.pack(len(request)) + request
        for _ in range(2):   # a connection the daemon closed (a restart), then a new one
            conn = await self._take()
            if conn is None:
                return None
            try:
                body = await self._exchange(conn, frame, timeout)
            except _Unsent:
                continue   # on a new connection (see _NOT_SENT)
            resp = read_answer(body)
            self.calls += 1
            return resp
        return None

    async def _exchange(self, conn: Conn, frame: bytes, timeout: float) -> bytes:
        r, w = conn
        ok = False
        try:
            w.write(frame)
            body = await _within(_read_frame(r), timeout)
            ok = True
            return body
        except asyncio.TimeoutError:
            raise LaneError(grpc.StatusCode.DEADLINE_EXCEEDED,
                            f"no answer on the match lane within {timeout:.3f} s") from None
        except OSError as e:
            if e.errno in _NOT_SENT:
                raise _Unsent() from e
            raise LaneError(grpc.StatusCode.UNAVAILABLE,
                            f"the match lane closed before answering: {e!r}") from None
        except asyncio.IncompleteReadError as e:
            raise LaneError(grpc.StatusCode.UNAVAILABLE,
                            f"the match lane closed before answering: {e!r}") from None
        finally:
            # A connection whose call did not end with a whole answer (an
            # error, a timeout, a cancelled caller) may still get that answer:
            # it must never be read as another call's.
            if ok and not self._closed and len(self._idle) < MAX_IDLE:
                self._idle.append(conn)
            else:
                w.close()

    def close(self) -> None:
        """No new connections; the idle ones close (calls in flight close
        theirs as they end)."""
        self._closed = True
        while self._idle:
            self._idle.pop()[1].close()


Conn = Tuple[asyncio.StreamReader, asyncio.StreamWriter]


class _Unsent(Exception):
    """The frame never reached the daemon whole (_NOT_SENT)."""


async def _read_frame(r: asyncio.StreamReader) -> bytes:
    n = LEN.unpack(await r.readexactly(LEN.size))[0]
    return await r.readexactly(n) if n else b""


async def _within(aw: Coroutine[Any, Any, bytes], timeout: float) -> bytes:
    """`aw`'s result, or asyncio.TimeoutError after `timeout` seconds; with
    asyncio.timeout where there is one (3.11), which, unlike wait_for,
    makes no task per call."""
    if not hasattr(asyncio, "timeout"):
        return await asyncio.wait_for(aw, timeout)
    async with asyncio.timeout(timeout):
        return await aw


def read_answer(body: bytes) -> bytes:
    """The MatchResponse bytes of an answer frame's body; LaneError for a
    status other than OK."""
    code = _CODES.get(body[0], grpc.StatusCode.UNKNOWN) if body else grpc.StatusCode.UNKNOWN
    if code is not grpc.StatusCode.OK:
        raise LaneError(code, body[1:].decode("utf-8", "replace"))
    return body[1:]


def _recv(s: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = s.recv_into(view[got:])
        if k == 0:
            raise ConnectionResetError("the daemon closed the match lane")
        got += k
    return bytes(buf)


def lane_for(target: str, tls: Any, token: Optional[str],
             kind: Callable[[str], L] = MatchLane) -> Optional[L]:  # type: ignore[assignment]
    """The lane (`kind`: MatchLane or AsyncMatchLane) of a client of `target`
    (a gRPC target), or None where there is none: TCP, TLS or a bearer token
    (a daemon with tokens has no lane)."""
    if tls or token or not target.startswith("unix:"):
        return None
    return kind(lane_path(target[len("unix:"):]))
