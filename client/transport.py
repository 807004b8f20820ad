"""The byte path a client uses: the daemon's shared-memory arena, or gRPC streams.

Mode "auto" maps the arena the daemon announces when it can (same host,
access to the file) and streams otherwise; "shm" makes a first registration
fail if the arena cannot be mapped; "stream" never maps. Once mapped, the
arena can still go away (the daemon restarted: a new file under the same
path): `live` notices and the client streams until a re-registration
announces an arena it can map again.
"""
from __future__ import annotations

import logging
from typing import Optional

import grpc

from kvkeeper.v1 import kvkeeper_pb2 as pb

from .errors import FailedPreconditionError
from .shm import ShmMapping

__all__ = ["TRANSPORTS", "Transport"]

log = logging.getLogger(__name__)

TRANSPORTS = ("auto", "shm", "stream")


class Transport:
    """The current choice: a ShmMapping of the daemon's arena, or None (stream)."""

    def __init__(self, mode: str) -> None:
        if mode not in TRANSPORTS:
            raise ValueError(f"transport must be one of {TRANSPORTS}, got {mode!r}")
        self.mode = mode
        self._mapping: Optional[ShmMapping] = None

    @property
    def name(self) -> str:
        """The byte path in use now: "shm" or "stream"."""
        return "shm" if self._mapping is not None else "stream"

    @property
    def mapping(self) -> Optional[ShmMapping]:
        """The mapping in use now, without checking the file (see `live`)."""
        return self._mapping

    def update(self, arena: Optional[pb.ShmArena], initial: bool) -> None:
        """Map the arena a registration announced, keeping the current mapping
        if it is the same arena; None (stream) where it cannot be mapped.
        FailedPreconditionError on a first registration in mode "shm"."""
        if self.mode == "stream":
            return
        old, new = self._mapping, None
        if arena is not None and arena.path:
            if (old is not None and old.path == arena.path
                    and old.arena_id == bytes(arena.arena_id) and old.still_valid()):
                return
            new = ShmMapping.attach(arena.path, arena.size_bytes, bytes(arena.arena_id))
        if old is not None:
            old.close()
        self._mapping = new
        if new is None:
            where = repr(arena.path) if arena is not None and arena.path else "no arena announced"
            if initial and self.mode == "shm":
                raise FailedPreconditionError(
                    f"transport='shm' but the daemon's arena cannot be mapped ({where}); "
                    "is the client on the daemon's host with access to /dev/shm? "
                    "Use transport='auto' to fall back to streaming",
                    grpc.StatusCode.FAILED_PRECONDITION)
            log.info("kvkeeper: shared memory not available (%s); streaming blocks", where)

    def live(self) -> Optional[ShmMapping]:
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

    def still_current(self, m: ShmMapping) -> bool:
        """Whether `m`, taken before an await, is still the mapping in use and
        still the daemon's arena (else the caller streams instead)."""
        return m is self._mapping and m.still_valid()

    def close(self) -> None:
        """Unmap. The client streams nothing after this: it is closing."""
        mapping, self._mapping = self._mapping, None
        if mapping is not None:
            mapping.close()
