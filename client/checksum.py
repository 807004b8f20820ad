"""Block checksums, computed over caller buffers without copying them.

The daemon stores the checksum a writer gives at commit and hands it back with
every load; only clients compute it, so a block corrupted anywhere in between
(host tier, disk tier, transport) is caught by the reader. CRC32 comes with
zlib, so it is the default; XXH3-64 is used only where `xxhash` is installed.
"""
from __future__ import annotations

from .arena_format import byte_view  # re-exported: callers take views from here

import asyncio
import zlib
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

from kvkeeper.v1 import kvkeeper_pb2 as pb

from .errors import ChecksumError

__all__ = ["ALGOS", "byte_view", "crc32", "checksum", "can_verify", "checksums", "verify"]

# Checksumming more than this many bytes runs in a worker thread (zlib drops
# the GIL), so one large save or load does not stall heartbeats and other calls.
OFFLOAD_BYTES = 4 << 20


def crc32(buf: Any) -> int:
    """zlib CRC32 of any C-contiguous buffer, as an unsigned int."""
    return zlib.crc32(byte_view(buf)) & 0xFFFFFFFF


ALGOS: Dict[int, Callable[[Any], int]] = {pb.CHECKSUM_CRC32: crc32}
"""ChecksumAlgo value -> function(buffer) -> int, for the algorithms this process can compute."""

try:  # optional: only if the environment already has it
    import xxhash as _xxhash

    def xxh3_64(buf: Any) -> int:
        """XXH3-64 of any C-contiguous buffer."""
        return _xxhash.xxh3_64_intdigest(byte_view(buf))

    ALGOS[pb.CHECKSUM_XXH3_64] = xxh3_64
    __all__.append("xxh3_64")
except ImportError:  # pragma: no cover - depends on the environment
    pass


def can_verify(algo: int) -> bool:
    """Whether blocks stored with `algo` can be checked here (NONE never is)."""
    return algo in ALGOS


def checksum(algo: int, buf: Any) -> int:
    """The checksum of `buf` with `algo` (a ChecksumAlgo value); KeyError if unknown."""
    return ALGOS[algo](buf)


async def checksums(algos: Sequence[int], bufs: Sequence[Any]) -> List[Optional[int]]:
    """Checksum of bufs[i] with algos[i] (None where the algo is unknown here),
    in a worker thread past OFFLOAD_BYTES."""
    def run() -> List[Optional[int]]:
        return [ALGOS[a](b) if a in ALGOS else None for a, b in zip(algos, bufs)]

    total = sum(byte_view(b).nbytes for a, b in zip(algos, bufs) if a in ALGOS)
    return await asyncio.to_thread(run) if total >= OFFLOAD_BYTES else run()


async def verify(expected: Sequence[Tuple[int, int]], bufs: Sequence[Any]) -> None:
    """Raise ChecksumError listing the bufs whose checksum differs from
    expected[i] = (checksum_algo, checksum); those this process cannot
    compute are not checked."""
    got = await checksums([a for a, _ in expected], bufs)
    bad = [i for i, ((_, want), have) in enumerate(zip(expected, got))
           if have is not None and have != want]
    if bad:
        raise ChecksumError(bad)
