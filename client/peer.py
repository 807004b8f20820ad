"""PeerClient: a blocking client of the daemon's peer socket (peer_wire.py).

Same-host engines use it to register their KV cache memory (as file
descriptors), to publish which kvkeeper keys their cache holds in which
block (and that block's generation), to ask which peer holds a prompt's
prefix, and to fetch that peer's descriptors. Each call has a deadline;
a daemon that is gone or slow makes it raise PeerUnavailable, which the
connector treats as a miss. One connection, used under a lock.
"""
from __future__ import annotations

import socket
import threading
from dataclasses import dataclass
from typing import Any, Dict, List, Optional, Sequence, Tuple

from .peer_wire import (ERR_INVALID, ERR_NOT_FOUND, ERR_UNAVAILABLE, PeerProtocolError,
                        close_fds, recv_message, send_message)

__all__ = ["PeerClient", "PeerError", "PeerMatch", "PeerUnavailable"]

# Publishes go out in pieces of at most this many blocks (a message stays small).
PUBLISH_BATCH = 2048


class PeerError(Exception):
    """The daemon refused a peer call; `code` is one of peer_wire's ERR_*."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code

    @property
    def not_found(self) -> bool:
        return self.code == ERR_NOT_FOUND


class PeerUnavailable(PeerError):
    """No answer: the peer socket is missing, closed, or past the deadline."""

    def __init__(self, message: str) -> None:
        super().__init__(ERR_UNAVAILABLE, message)


@dataclass(frozen=True)
class PeerMatch:
    """A peer's answer for a key chain: the segment of the engine holding
    the longest prefix, and (block, generation) of each of those keys."""

    segment: Optional[str]
    blocks: Tuple[Tuple[int, int], ...]

    @property
    def matched(self) -> int:
        return len(self.blocks)


class PeerClient:
    def __init__(self, path: str, timeout: float = 1.0) -> None:
        self.path = path
        self.timeout = timeout
        self._sock: Optional[socket.socket] = None
        self._lock = threading.Lock()

    def _connect(self) -> socket.socket:
        if self._sock is None:
            s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
            s.settimeout(self.timeout)
            try:
                s.connect(self.path)
            except OSError as e:
                s.close()
                raise PeerUnavailable(f"cannot reach the peer socket {self.path}: {e}") from None
            self._sock = s
        return self._sock

    def _drop(self) -> None:
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def call(self, request: Dict[str, Any], fds: Sequence[int] = ()
             ) -> Tuple[Dict[str, Any], List[int]]:
        """One request, its answer and the descriptors that came with it (the
        caller owns them). PeerError when refused, PeerUnavailable without answer."""
        with self._lock:
            sock = self._connect()
            try:
                send_message(sock, request, fds)
                reply, got = recv_message(sock)
            except (OSError, PeerProtocolError) as e:
                self._drop()   # the stream may hold half a message: start afresh
                raise PeerUnavailable(f"peer call {request.get('op')!r} failed: {e}") from None
        if not reply.get("ok"):
            close_fds(got)
            raise PeerError(str(reply.get("code") or ERR_INVALID), str(reply.get("error")))
        return reply, got

    def register(self, session: str, engine: str, descriptor: Dict[str, Any],
                 kv_fd: int, gens_fd: int) -> str:
        """Hand the daemon this engine's KV cache segment and its generation
        array; the segment's id (it lives as long as `session`)."""
        reply, _ = self.call({"op": "register", "session": session, "engine": engine,
                              "descriptor": descriptor}, (kv_fd, gens_fd))
        return str(reply["segment"])

    def publish(self, session: str, segment: str,
                blocks: Sequence[Tuple[bytes, int, int]]) -> int:
        """(key, block id, generation) now held by `segment`; how many were indexed."""
        n = 0
        for i in range(0, len(blocks), PUBLISH_BATCH):
            part = [[k.hex(), int(b), int(g)] for k, b, g in blocks[i:i + PUBLISH_BATCH]]
            reply, _ = self.call({"op": "publish", "session": session, "segment": segment,
                                  "blocks": part})
            n += int(reply.get("indexed", 0))
        return n

    def match(self, session: str, engine: str, keys: Sequence[bytes]) -> PeerMatch:
        """The longest prefix of `keys` another engine (not `engine`) holds."""
        reply, _ = self.call({"op": "match", "session": session, "engine": engine,
                              "keys": [k.hex() for k in keys]})
        blocks = tuple((int(b), int(g)) for b, g in reply.get("blocks") or ())
        return PeerMatch(reply.get("segment") if blocks else None, blocks)

    def get(self, session: str, segment: str) -> Tuple[Dict[str, Any], List[int]]:
        """Segment `segment`'s descriptor and its (KV, generations) descriptors,
        read-only; the caller owns and closes them."""
        reply, fds = self.call({"op": "get", "session": session, "segment": segment})
        if len(fds) != 2:
            close_fds(fds)
            raise PeerError(ERR_INVALID, f"the daemon sent {len(fds)} descriptors, not 2")
        return dict(reply["descriptor"]), fds

    def close(self) -> None:
        with self._lock:
            self._drop()
