"""Client mapping of the daemon's host-tier arena (a file under /dev/shm).

A client on the same host as the daemon maps the arena named in
RegisterSessionResponse.arena and copies block bytes in and out itself, one
memcpy per extent; the daemon only hands out extents (file offset, length).
`ShmMapping.attach` returns None when the file is not there, has another
size, or shows another arena id: the client is on another host, or the daemon
restarted, and must stream instead.

The mapping itself (views, copies, closing with live views, `still_valid`) is
kvkeeper.client.arena_mapping's, the same class the daemon's arena uses; the
header layout is kvkeeper.client.arena_format's. This module must not import
kvkeeper.server: clients install without the daemon.
"""
from __future__ import annotations

import os
from typing import Any, Optional, Sequence

from .arena_format import ARENA_ID_BYTES, HEADER_BYTES, HEADER_STRUCT, MAGIC, parse_header
from .arena_mapping import ArenaMapping, file_id, map_file, populate

# HEADER_BYTES and MAGIC: the layout this mapping reads, for callers that check it.
__all__ = ["ShmMapping", "HEADER_BYTES", "MAGIC"]


class ShmMapping(ArenaMapping):
    """A client's read-write mapping of the daemon's arena. Create with `attach`."""

    __slots__ = ()

    @classmethod
    def attach(cls, path: str, size_bytes: int, arena_id: bytes,
               prefault: bool = True) -> Optional["ShmMapping"]:
        """Map the arena at `path` if it is the one the daemon described, else None.
        prefault: map the pages that hold data at once (arena_mapping.populate).

        None means: no such file, another size, another id or not an arena
        (another host, or the daemon restarted), or no permission to map it.
        """
        try:
            size_bytes = int(size_bytes)
            arena_id = bytes(memoryview(arena_id))
        except (TypeError, ValueError):
            return None
        if size_bytes < HEADER_BYTES or len(arena_id) != ARENA_ID_BYTES:
            return None
        try:
            fd = os.open(path, os.O_RDWR | getattr(os, "O_CLOEXEC", 0))
        except (OSError, ValueError):  # missing, no permission, bad path
            return None
        try:
            st = os.fstat(fd)
            if st.st_size != size_bytes:
                return None
            # Check the id before mapping, with the same fd so it is the same file.
            head = parse_header(os.pread(fd, HEADER_STRUCT.size, 0))
            if head is None or head[0] != arena_id:
                return None
            mm = map_file(fd, size_bytes)
            _, page_bytes, page_count, data_offset = head
            if not (HEADER_BYTES <= data_offset <= size_bytes):
                mm.close()
                return None
            if prefault:
                # Loads then copy without page faults: a fresh mapping faults
                # once per 4 KiB page it touches first, ~64 per 256 KiB block.
                populate(mm, fd, data_offset, size_bytes)
        except (OSError, ValueError):
            return None
        finally:
            os.close(fd)
        return cls(path, size_bytes, arena_id, page_bytes, page_count, data_offset,
                   file_id(st), mm)

    def write(self, extents: Sequence[Any], data: Any, start: int = 0, *,
              whole: bool = True) -> None:
        """Copy `data`, the whole block: a client writes only blocks it
        reserved whole, and a short write would leave another block's bytes
        in place for the commit to publish (see ArenaMapping.write)."""
        super().write(extents, data, start, whole=whole)
