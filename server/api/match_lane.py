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
"""
from __future__ import annotations

import asyncio
import logging
import os
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
        self.requests = 0   # frames answered (LaneCollector)

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
            s.listen(64)
        except BaseException:
            s.close()
            raise
        s.setblocking(False)
        self._sock = s

    async def start(self) -> None:
        assert self._sock is not None, "bind() first"
        self._server = await asyncio.start_unix_server(self._serve, sock=self._sock)

    async def stop(self) -> None:
        """After the gRPC server's stop: the handler refuses (UNAVAILABLE)
        since the drain began, and now the connections close."""
        if self._server is not None:
            self._server.close()
            self._server = None
        self._sock = None
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
        if os.path.lexists(self.path):
            os.unlink(self.path)

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        if task is not None:
            self._conns[task] = writer
        try:
            while True:
                n = LEN.unpack(await reader.readexactly(LEN.size))[0]
                if n > self._max:
                    log.warning("match lane: a frame of %d bytes exceeds %d; connection closed",
                                n, self._max)
                    return
                writer.write(await self.answer(await reader.readexactly(n)))
                await writer.drain()
        except (asyncio.IncompleteReadError, ConnectionError):
            return   # the client went away, or broke the framing
        finally:
            if task is not None:
                self._conns.pop(task, None)
            writer.close()

    async def answer(self, body: bytes) -> bytes:
        """The answer frame to one request frame's body."""
        self.requests += 1
        ctx = LaneContext(self._peer)
        resp = await self.servicer.Match(_parse(body), ctx)
        if ctx.code is not None and ctx.code is not grpc.StatusCode.OK:
            return answer_frame(ctx.code, ctx.details.encode("utf-8", "replace"))
        return answer_frame(grpc.StatusCode.OK, frame_or_message(resp))


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
