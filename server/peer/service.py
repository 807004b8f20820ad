"""PeerService: the daemon's peer socket (client/peer_wire.py's framing), on its event loop.

Beside the gRPC socket, at its path plus ".peer" and with its mode and
group: whoever may use one may use the other (one trust domain, as the
arena). Every request names a live session (the random session id is the
capability, as on the gRPC socket); the session's namespace scopes what it
sees. Ops:

  register  {engine, descriptor} + (KV, generations) descriptors: the
            session's segment, replacing an earlier one -> {segment}
  publish   {segment, blocks: [[key hex, block, generation], ...]}
  match     {engine, keys: [hex, ...]} -> {segment, blocks: [[block, gen]]}:
            the longest prefix another engine of the namespace holds
  get       {segment} -> {descriptor} + (KV, generations) descriptors

The daemon keeps the descriptors it was handed and maps only the
generation array (read-only, to drop stale entries at lookup); it never
reads or copies KV. A segment is forgotten (its descriptors closed) when
its session ends: checked before every lookup and by a sweep every second.
"""
from __future__ import annotations

import array
import asyncio
import logging
import mmap
import os
import socket
import time
from dataclasses import dataclass
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvkeeper.client.peer_segment import ATTACHED, attached_slot
from kvkeeper.client.peer_wire import (ERR_INVALID, ERR_NOT_FOUND, ERR_UNAVAILABLE, MAX_FDS,
                                       PeerProtocolError, close_fds, decode_body, encode,
                                       parse_head)

from ..errors import ClientError, InvalidArgument, NotFound
from ..ids import SessionId
from ..ledger import Ledger
from ..ledger.sessions import tag
from .registry import PeerRegistry, Segment

__all__ = ["PeerService"]

log = logging.getLogger("kvkeeper.peer")

SWEEP_INTERVAL_S = 1.0
_HEAD = 4


class _Gens:
    """The daemon's read-only mapping of a holder's generation array."""

    def __init__(self, fd: int, size: int, num_blocks: int) -> None:
        self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ)
        self._view = memoryview(self._mm).cast("B").cast("Q")
        self._flag = attached_slot(num_blocks)

    def gen_of(self, block: int) -> int:
        return self._view[block]

    def attached(self) -> bool:
        return self._view[self._flag] == ATTACHED

    def close(self) -> None:
        self._view.release()
        self._mm.close()


@dataclass
class PeerStats:
    """What metrics.py exports; kept by the event loop."""

    segments: int = 0
    published: int = 0
    lookups: int = 0
    hits: int = 0
    hit_blocks: int = 0


class PeerService:
    def __init__(self, ledger: Ledger, path: str, mode: int = 0o660,
                 give_group: Optional[Callable[[str], None]] = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.ledger = ledger
        self.path = path
        self._mode = mode
        self._give_group = give_group
        self._clock = clock
        self._gens: Dict[str, _Gens] = {}
        self.registry = PeerRegistry(self._release)
        self.stats = PeerStats()
        self._sock: Optional[socket.socket] = None
        self._tasks: set = set()
        self._sweeper: Optional[asyncio.Task[None]] = None

    # ---- life cycle

    def bind(self) -> None:
        if os.path.lexists(self.path):
            os.unlink(self.path)   # the gRPC socket beside it was claimed first
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        s.bind(self.path)
        os.chmod(self.path, self._mode)
        if self._give_group is not None:
            self._give_group(self.path)
        s.listen(64)
        s.setblocking(False)
        self._sock = s

    async def start(self) -> None:
        assert self._sock is not None, "bind() first"
        loop = asyncio.get_running_loop()
        loop.add_reader(self._sock.fileno(), self._accept)
        self._sweeper = loop.create_task(self._sweep())

    def unbind(self) -> None:
        """Close the listening socket and remove its file: what bind() made
        (stop()'s last step, and all a daemon that never served undoes)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None
            if os.path.lexists(self.path):
                os.unlink(self.path)

    async def stop(self) -> None:
        if self._sock is not None:
            asyncio.get_running_loop().remove_reader(self._sock.fileno())
        self.unbind()
        for t in [self._sweeper, *self._tasks]:
            if t is not None:
                t.cancel()
        self.registry.close()

    async def _sweep(self) -> None:
        while True:
            await asyncio.sleep(SWEEP_INTERVAL_S)
            self._forget_ended()
            self._count()

    def _forget_ended(self) -> None:
        now = self._clock()
        self.registry.sweep(lambda sid: self._live(sid, now) is not None)

    def _release(self, seg: Segment) -> None:
        gens = self._gens.pop(seg.id, None)
        if gens is not None:
            gens.close()
        close_fds((seg.kv_fd, seg.gens_fd))
        log.info("peer segment of session %s (engine %s) forgotten", tag(seg.session),
                 seg.engine[:64])

    # ---- connections

    def _accept(self) -> None:
        assert self._sock is not None
        try:
            conn, _ = self._sock.accept()
        except (BlockingIOError, InterruptedError):
            return
        conn.setblocking(False)
        task = asyncio.get_running_loop().create_task(self._serve(conn))
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _serve(self, conn: socket.socket) -> None:
        try:
            while True:
                got = await self._recv(conn)
                if got is None:
                    return
                msg, fds = got
                reply, out = self._answer(msg, fds)
                self._count()
                await self._send(conn, reply, out)
        except (OSError, PeerProtocolError) as e:
            log.debug("peer connection ended: %s", e)
        finally:
            conn.close()

    def _count(self) -> None:
        segs = list(self.registry.segments.values())
        self.stats.segments = len(segs)
        self.stats.published = sum(len(s.index) for s in segs)

    async def _wait(self, conn: socket.socket, write: bool = False) -> None:
        loop = asyncio.get_running_loop()
        fut = loop.create_future()
        fd = conn.fileno()

        def ready() -> None:
            if not fut.done():
                fut.set_result(None)

        (loop.add_writer if write else loop.add_reader)(fd, ready)
        try:
            await fut
        finally:
            (loop.remove_writer if write else loop.remove_reader)(fd)

    async def _recv(self, conn: socket.socket) -> Optional[Tuple[Dict[str, Any], List[int]]]:
        while True:
            try:
                data, anc, flags, _ = conn.recvmsg(_HEAD, socket.CMSG_SPACE(MAX_FDS * 4))
                break
            except (BlockingIOError, InterruptedError):
                await self._wait(conn)
        if not data:
            return None
        loop = asyncio.get_running_loop()
        while len(data) < _HEAD:
            more = await loop.sock_recv(conn, _HEAD - len(data))
            if not more:
                raise PeerProtocolError("the connection ended inside a message")
            data += more
        n, fds = parse_head(data, anc, flags)
        try:
            body = bytearray()
            while len(body) < n:
                chunk = await loop.sock_recv(conn, n - len(body))
                if not chunk:
                    raise PeerProtocolError("the connection ended inside a message")
                body += chunk
            return decode_body(bytes(body)), fds
        except BaseException:
            close_fds(fds)
            raise

    async def _send(self, conn: socket.socket, reply: Dict[str, Any], fds: Sequence[int]) -> None:
        data = encode(reply)
        anc = ([(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array("i", fds).tobytes())]
               if fds else [])
        while True:
            try:
                sent = conn.sendmsg([data[:_HEAD]], anc)
                break
            except (BlockingIOError, InterruptedError):
                await self._wait(conn, write=True)
        await asyncio.get_running_loop().sock_sendall(conn, data[sent:])

    # ---- requests

    def _live(self, sid: Any, now: float) -> Any:
        session = self.ledger.sessions.get(SessionId(sid)) if isinstance(sid, str) else None
        if session is None or session.expires_at < now:
            return None
        return session

    def _answer(self, msg: Dict[str, Any], fds: List[int]) -> Tuple[Dict[str, Any], List[int]]:
        """The reply to one request, and the descriptors to send with it. The
        descriptors received are kept by a registration, closed otherwise."""
        kept = False
        try:
            session = self._live(msg.get("session"), self._clock())
            if session is None:
                raise NotFound("unknown session: it ended, expired or was never issued; "
                               "register a session over gRPC first")
            op = msg.get("op")
            if op == "register":
                reply = self._register(session, msg, fds)
                kept = True
                return reply, []
            if fds:
                raise InvalidArgument(f"op {op!r} takes no descriptors")
            if op == "publish":
                n = self.registry.publish(session.id, msg.get("segment"), msg.get("blocks"))
                return {"ok": True, "indexed": n}, []
            if op == "match":
                return self._match(session, msg), []
            if op == "get":
                self._forget_ended()
                seg = self.registry.get(session.ns.id, msg.get("segment"))
                return {"ok": True, "descriptor": seg.descriptor}, [seg.kv_fd, seg.gens_fd]
            raise InvalidArgument(f"unknown peer op {op!r}")
        except ClientError as e:
            code = ERR_NOT_FOUND if isinstance(e, NotFound) else ERR_INVALID
            return {"ok": False, "code": code, "error": str(e)}, []
        except Exception as e:  # noqa: BLE001 - one bad request must not end the service
            log.exception("peer request failed")
            return {"ok": False, "code": ERR_UNAVAILABLE, "error": f"internal error: {e}"}, []
        finally:
            if not kept:
                close_fds(fds)

    def _register(self, session: Any, msg: Dict[str, Any], fds: List[int]) -> Dict[str, Any]:
        if len(fds) != 2:
            raise InvalidArgument(f"register takes 2 descriptors (KV, generations), got {len(fds)}")
        kv_fd, gens_fd = fds
        kv_size, gens_size = os.fstat(kv_fd).st_size, os.fstat(gens_fd).st_size
        desc = msg.get("descriptor")
        n = desc.get("num_blocks") if isinstance(desc, dict) else None
        gens = None
        if isinstance(n, int) and not isinstance(n, bool) and 0 < n and \
                (n + 1) * 8 <= gens_size:
            gens = _Gens(gens_fd, gens_size, n)
        try:
            if gens is None:
                raise InvalidArgument(f"the generation array ({gens_size} bytes) does not fit "
                                      f"num_blocks {n!r}")
            seg = self.registry.register(session.id, session.ns.id, msg.get("engine"), desc,
                                         kv_fd, gens_fd, kv_size, gens_size, gens.gen_of,
                                         gens.attached)
        except BaseException:
            if gens is not None:
                gens.close()
            raise
        self._gens[seg.id] = gens
        log.info("peer segment of session %s (engine %s): %d blocks, %d bytes", tag(session.id),
                 seg.engine[:64], seg.num_blocks, kv_size)
        return {"ok": True, "segment": seg.id}

    def _match(self, session: Any, msg: Dict[str, Any]) -> Dict[str, Any]:
        keys = msg.get("keys")
        if not isinstance(keys, list):
            raise InvalidArgument("keys must be a list of hex strings")
        try:
            raw = [bytes.fromhex(k) for k in keys]
        except (TypeError, ValueError):
            raise InvalidArgument("keys must be hex strings") from None
        self._forget_ended()
        seg, blocks = self.registry.match(session.ns.id, str(msg.get("engine") or ""), raw)
        self.stats.lookups += 1
        if blocks:
            self.stats.hits += 1
            self.stats.hit_blocks += len(blocks)
        return {"ok": True, "segment": seg.id if seg is not None else None,
                "blocks": [list(b) for b in blocks]}
