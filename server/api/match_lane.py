"""MatchLaneServer: Match on a plain unix socket (client/match_lane.py's framing).

The lane adds a transport, not a handler: each request goes through the
servicer's Match, the one @rpc-wrapped handler, with a stand-in for
grpc's context. So a lane call is admitted, refused while draining, mapped
to its status, logged and timed into kvkeeper_rpc_duration_seconds exactly
as the same call over gRPC; the caller's identity is the unix socket's
(security/identity.py: "socket"). app.py binds it only without a tokens
file.

A frame over the daemon's message limit, or a connection that breaks the
framing, ends that connection (the client asks over gRPC); anything else,
a request that does not parse included, gets a status answer.

A caller that hangs up before its answer is ready has given up (a timeout,
a cancelled call: the clients close such a connection, never reuse it). A
lease its Match was granted meanwhile is released, not left pinned until
the session ends: nobody would ever hear of it. gRPC cancels such a
handler instead; the lane has no cancel, so it looks once the answer is
ready (one poll of the socket, only for an answer that carries a lease).
A caller that hangs up after the answer is written, before it reads it, is
the one case left: as a gRPC answer that reaches a client just past its
deadline, that lease lasts until its session ends.
"""
from __future__ import annotations

import asyncio
import logging
import os
import select
import socket
from typing import Any, Callable, Dict, Iterator, List, Optional

import grpc
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvkeeper.client.match_lane import LEN, answer_frame
from kvkeeper.client.wire import frame_or_message
from kvkeeper.v1 import kvkeeper_pb2 as pb

from .decoding import guard

__all__ = ["LaneCollector", "MatchLaneServer"]

log = logging.getLogger("kvkeeper.api")

_parse = guard("KVKeeper/Match", "kvkeeper.v1.MatchRequest", pb.MatchRequest.FromString)


class LaneContext:
    """What the handler wrapper and Match ask of grpc's ServicerContext."""

    __slots__ = ("_peer", "code", "details")

    def __init__(self, peer: str) -> None:
        self._peer = peer
        self.code: Optional[grpc.StatusCode] = None
        self.details = ""

    def peer(self) -> str:
        return self._peer

    def auth_context(self) -> dict:
        return {}

    def set_code(self, code: grpc.StatusCode) -> None:
        self.code = code

    def set_details(self, details: str) -> None:
        self.details = details


class MatchLaneServer:
    def __init__(self, servicer: Any, path: str, mode: int = 0o660,
                 give_group: Optional[Callable[[str], None]] = None,
                 max_frame_bytes: int = 64 << 20) -> None:
        self.servicer = servicer
        self.path = path
        self._mode = mode
        self._give_group = give_group
        self._max = max_frame_bytes
        self._peer = f"unix:{path}"
        self._sock: Optional[socket.socket] = None
        self._server: Optional[asyncio.AbstractServer] = None
        self._conns: Dict[asyncio.Task[Any], asyncio.StreamWriter] = {}
        self._stopping = False
        self.requests = 0   # frames answered (LaneCollector)
        self.unheard = 0    # leases released because their caller hung up first

    @property
    def connections(self) -> int:
        return len(self._conns)

    def bind(self) -> None:
        if os.path.lexists(self.path):
            os.unlink(self.path)   # the gRPC socket beside it was claimed first
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            s.bind(self.path)
            os.chmod(self.path, self._mode)
            if self._give_group is not None:
                self._give_group(self.path)
            # The most the kernel allows: a burst of new connections past the
            # queue would wait (blocking clients) or go over gRPC (async ones).
            s.listen(socket.SOMAXCONN)
        except BaseException:
            s.close()
            raise
        s.setblocking(False)
        self._sock = s

    async def start(self) -> None:
        assert self._sock is not None, "bind() first"
        self._server = await asyncio.start_unix_server(self._serve, sock=self._sock)

    def unbind(self) -> None:
        """Close the listening socket (the server's, once started) and remove
        its file: stop()'s last step, and all a daemon that never served undoes."""
        if self._sock is not None:
            self._sock.close()   # idempotent: a started server closed it already
            self._sock = None
        if os.path.lexists(self.path):
            os.unlink(self.path)

    async def stop(self) -> None:
        """After the gRPC server's stop: the handler refuses (UNAVAILABLE)
        since the drain began, and now the connections close."""
        self._stopping = True   # a connection accepted from here on closes at once
        if self._server is not None:
            self._server.close()
            self._server = None
        # Closing a connection ends its task at its next read (a call being
        # answered ends first); cancelling the tasks instead would have asyncio
        # log each one's CancelledError as an error.
        for w in list(self._conns.values()):
            w.close()
        if self._conns:
            _, late = await asyncio.wait(list(self._conns), timeout=5.0)
            for t in late:
                t.cancel()
            if late:
                await asyncio.gather(*late, return_exceptions=True)
        self.unbind()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if self._stopping:
            writer.close()
            return
        if task is not None:
            self._conns[task] = writer
        hung_up = _hang_up_check(reader, writer)
        try:
            while True:
                n = LEN.unpack(await reader.readexactly(LEN.size))[0]
                if n > self._max:
                    log.warning("match lane: a frame of %d bytes exceeds %d; connection closed",
                                n, self._max)
                    return
                frame = await self.answer(await reader.readexactly(n), hung_up)
                if frame is None:
                    return
                writer.write(frame)
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return   # the client went away, or broke the framing
        finally:
            if task is not None:
                self._conns.pop(task, None)
            writer.close()

    async def answer(self, body: bytes,
                     hung_up: Callable[[], bool] = lambda: False) -> Optional[bytes]:
        """The answer frame to one request frame's body; None when the caller
        hung up (`hung_up`) before a leased answer was ready: its lease is
        released (see the module docstring)."""
        self.requests += 1
        ctx = LaneContext(self._peer)
        req = _parse(body)
        resp = await self.servicer.Match(req, ctx)
        if ctx.code is not None and ctx.code is not grpc.StatusCode.OK:
            return answer_frame(ctx.code, ctx.details.encode("utf-8", "replace"))
        data = frame_or_message(resp)
        if req.lease and hung_up():   # req parsed: the handler answered OK
            lease = pb.MatchResponse.FromString(data).lease_id
            if lease:
                self.unheard += 1
                log.info("match lane: the caller of a leased Match hung up before its answer; "
                         "lease %d released", lease)
                await self.servicer.Release(pb.ReleaseRequest(session_id=req.session_id,
                                                              lease_id=lease),
                                            LaneContext(self._peer))
            return None
        return answer_frame(grpc.StatusCode.OK, data)


def _hang_up_check(reader: asyncio.StreamReader,
                   writer: asyncio.StreamWriter) -> Callable[[], bool]:
    """Whether the client of this connection has closed its end. The event
    loop may not have read the end of the stream yet (the handler ran
    without yielding), so the socket is polled too: one poll(2), no wait."""
    sock = writer.get_extra_info("socket")
    poller = select.poll()
    if sock is not None:
        poller.register(sock.fileno(), select.POLLRDHUP)

    def hung_up() -> bool:
        if reader.at_eof():
            return True
        try:
            return any(ev & (select.POLLRDHUP | select.POLLHUP | select.POLLERR)
                       for _, ev in poller.poll(0))
        except OSError:
            return True
    return hung_up


class LaneCollector:
    """The lane's series, read at scrape time (no labels):

        kvkeeper_match_lane_requests_total  Match calls that came on the lane;
            kvkeeper_rpc_duration_seconds{method="Match"} counts them too, so
            the rest of its count came over gRPC
        kvkeeper_match_lane_connections     clients' lane connections open now

    As the peer socket's collector: the event loop updates the integers, a
    scrape only reads them."""

    def __init__(self, lane: MatchLaneServer) -> None:
        self._lane = lane

    def _families(self) -> List[Metric]:
        requests = CounterMetricFamily("kvkeeper_match_lane_requests", "Match calls that came "
                                       "on the match lane (the rest came over gRPC).")
        requests.add_metric([], self._lane.requests)
        conns = GaugeMetricFamily("kvkeeper_match_lane_connections",
                                  "Clients' match lane connections open now.")
        conns.add_metric([], self._lane.connections)
        return [requests, conns]

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        return iter(self._families())
