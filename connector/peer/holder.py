"""PeerHolder: the worker's KV cache offered to same-host peers.

At registration the cache is in shared memory (share.py) and the engine's
generation array is open (gens.py); the segment is registered with the
daemon on the worker's I/O thread, under the worker's session (the daemon
forgets it when that session ends; a new session, after a daemon restart,
registers it again). After each forward the worker notes the full blocks
it filled (saves) or loaded, with each block's generation read right then,
while the block still belongs to its request (read later, a reused block
would be published under its old key); the I/O thread publishes them. A
publish that fails is dropped: entries are hints, and a lost one is a miss.
"""
from __future__ import annotations

import logging
import os
import threading
from typing import Any, Dict, List, Optional, Sequence, Tuple

from kvkeeper.client.peer import PeerClient, PeerError

from ..io_thread import IoThread
from ..link import DaemonLink
from .gens import Generations
from .share import SharedKV

__all__ = ["PeerHolder"]

log = logging.getLogger("kvkeeper.connector")

# Entries noted but not yet published, at most (beyond, the oldest are dropped).
MAX_PENDING = 1 << 16


class PeerHolder:
    def __init__(self, link: DaemonLink, client: PeerClient, io: IoThread, engine: str,
                 shared: SharedKV, descriptor: Dict[str, Any], gens: Generations,
                 gens_fd: int) -> None:
        self._link = link
        self._client = client
        self._io = io
        self.engine = engine
        self._shared = shared
        self.descriptor = descriptor
        self.gens = gens
        self._gens_fd = gens_fd
        self._lock = threading.Lock()
        self._pending: List[Tuple[bytes, int, int]] = []
        self._queued = False
        self.segment: Optional[str] = None
        self._session = ""
        self.published = 0

    def start(self) -> None:
        self._io.submit(self._flush)

    def _session_id(self) -> str:
        sid = self._link.session_id()
        if not sid:   # not connected yet: connect (this is the I/O thread)
            sid = self._link.call(lambda c: c.session_id, "peer")
        return sid

    def _register(self, sid: str) -> None:
        self.segment = self._client.register(sid, self.engine, self.descriptor,
                                             self._shared.fd, self._gens_fd)
        self._session = sid
        log.info("kvkeeper: KV cache registered for same-host peers (%d blocks, segment %s)",
                 self.descriptor["num_blocks"], self.segment[:12])

    def note(self, keys: Sequence[bytes], block_ids: Sequence[int]) -> None:
        """Blocks block_ids[i] now hold keys[i] (vLLM's thread, right after
        the forward that filled or loaded them)."""
        n = min(len(keys), len(block_ids))
        if not n:
            return
        gens = self.gens.read(list(block_ids[:n]))
        with self._lock:
            self._pending.extend(zip(keys[:n], (int(b) for b in block_ids[:n]),
                                     (int(g) for g in gens)))
            if len(self._pending) > MAX_PENDING:
                del self._pending[:len(self._pending) - MAX_PENDING]
            if self._queued:
                return
            self._queued = True
        self._io.submit(self._flush)

    def _flush(self) -> None:
        with self._lock:
            entries, self._pending, self._queued = self._pending, [], False
        try:
            sid = self._session_id()
            if self.segment is None or sid != self._session:
                self._register(sid)
            if entries:
                try:
                    self.published += self._client.publish(sid, self.segment or "", entries)
                except PeerError as e:
                    if not e.not_found:
                        raise
                    self._register(sid)   # the daemon forgot it (restarted, session ended)
                    self.published += self._client.publish(sid, self.segment or "", entries)
        except Exception as e:  # noqa: BLE001 - hints only: a lost publish is a later miss
            log.debug("kvkeeper: publishing %d block(s) to peers failed: %s", len(entries), e)

    def flush(self, timeout: float) -> bool:
        """Wait until what was noted so far is sent (tests)."""
        try:
            self._io.submit(self._flush).result(timeout)
            return True
        except Exception:  # noqa: BLE001
            return False

    def close(self) -> None:
        self._client.close()
        self.gens.close()
        self._shared.close()
        try:
            os.close(self._gens_fd)
        except OSError:
            pass

    def describe(self) -> Dict[str, Any]:
        return {"segment": self.segment, "published": self.published,
                "num_blocks": self.descriptor["num_blocks"]}
