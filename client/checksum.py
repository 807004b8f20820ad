"""Block checksums, computed over caller buffers without copying them.

The daemon stores the checksum a writer gives at commit and hands it back with
every load; only clients compute it, so a block corrupted anywhere in between
(host tier, disk tier, transport) is caught by the reader. The default is
XXH3-64 (`xxhash`): `kvkeeper bench checksum` measured it at memory speed
(~15 GB/s here against ~2-3.5 GB/s for zlib's CRC32, and as fast as hardware
CRC32C from google-crc32c/crc32c; a 64-bit hash also misses fewer
corruptions). CRC32 stays computable, so blocks committed with it by older
clients still verify: a reader always checks with the algorithm the block was
stored with, whatever its own saves use.
"""
from __future__ import annotations

from .arena_format import byte_view  # re-exported: callers take views from here

import asyncio
import zlib
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import xxhash

from kvkeeper.v1 import kvkeeper_pb2 as pb

from .errors import ChecksumError

__all__ = ["ALGOS", "DEFAULT", "NAMES", "Hasher", "StreamSums", "byte_view", "crc32", "xxh3_64",
           "checksum", "checksum_parts", "can_verify", "algo_of", "checksums", "verify"]

# Checksumming more than this many bytes runs in a worker thread (zlib and xxhash
# drop the GIL), so one large save or load does not stall heartbeats and other calls.
OFFLOAD_BYTES = 4 << 20


def crc32(buf: Any) -> int:
    """zlib CRC32 of any C-contiguous buffer, as an unsigned int."""
    return zlib.crc32(byte_view(buf)) & 0xFFFFFFFF


def xxh3_64(buf: Any) -> int:
    """XXH3-64 (seed 0) of any C-contiguous buffer, as an unsigned int."""
    return xxhash.xxh3_64_intdigest(byte_view(buf))


ALGOS: Dict[int, Callable[[Any], int]] = {pb.CHECKSUM_CRC32: crc32,
                                          pb.CHECKSUM_XXH3_64: xxh3_64}
"""ChecksumAlgo value -> function(buffer) -> int, for the algorithms this process can compute."""

NAMES: Dict[str, int] = {"xxh3": pb.CHECKSUM_XXH3_64, "crc32": pb.CHECKSUM_CRC32,
                         "none": pb.CHECKSUM_NONE}
"""The names clients and the connector's kvkeeper_checksum accept -> ChecksumAlgo."""

DEFAULT = "xxh3"
"""What saves use unless told otherwise."""


def algo_of(name: str) -> int:
    """The ChecksumAlgo value of `name` (a NAMES key); ValueError naming the choices."""
    try:
        return NAMES[name]
    except (KeyError, TypeError):
        raise ValueError(f"checksum must be one of {tuple(NAMES)}, got {name!r}") from None


def can_verify(algo: int) -> bool:
    """Whether blocks stored with `algo` can be checked here (NONE never is)."""
    return algo in ALGOS


def checksum(algo: int, buf: Any) -> int:
    """The checksum of `buf` with `algo` (a ChecksumAlgo value); KeyError if unknown."""
    return ALGOS[algo](buf)


class Hasher:
    """The checksum with one algorithm of bytes given piece by piece, in order
    (CRC32 chained, XXH3-64 through its streaming state: the same value as
    the one-shot function over the joined bytes). `feed` takes flat byte
    views only (arena_format.byte_view's), without `update`'s conversion: the
    fused copies call it once per piece."""

    __slots__ = ("algo", "_crc", "_xxh", "feed")

    def __init__(self, algo: int) -> None:
        if algo not in ALGOS:
            raise KeyError(algo)
        self.algo = algo
        self._crc = 0
        self._xxh = xxhash.xxh3_64() if algo == pb.CHECKSUM_XXH3_64 else None
        self.feed: Callable[[memoryview], Any] = (
            self._xxh.update if self._xxh is not None else self._feed_crc)

    def _feed_crc(self, mv: memoryview) -> None:
        self._crc = zlib.crc32(mv, self._crc)

    def update(self, buf: Any) -> None:
        self.feed(byte_view(buf))

    def digest(self) -> int:
        return self._xxh.intdigest() if self._xxh is not None else self._crc & 0xFFFFFFFF


def checksum_parts(algo: int, parts: Iterable[Any]) -> int:
    """The checksum with `algo` of the concatenation of `parts` (C-contiguous
    buffers, in order) without joining them. KeyError if `algo` is unknown."""
    h = Hasher(algo)
    for p in parts:
        h.update(p)
    return h.digest()


async def checksums(algos: Sequence[int], bufs: Sequence[Any]) -> List[Optional[int]]:
    """Checksum of bufs[i] with algos[i] (None where the algo is unknown here),
    in a worker thread past OFFLOAD_BYTES."""
    def run() -> List[Optional[int]]:
        return [ALGOS[a](b) if a in ALGOS else None for a, b in zip(algos, bufs)]

    total = sum(byte_view(b).nbytes for a, b in zip(algos, bufs) if a in ALGOS)
    return await asyncio.to_thread(run) if total >= OFFLOAD_BYTES else run()


async def verify(expected: Sequence[Tuple[int, int]], bufs: Sequence[Any],
                 taken: Optional["StreamSums"] = None) -> None:
    """Raise ChecksumError listing the bufs whose checksum differs from
    expected[i] = (checksum_algo, checksum); those this process cannot
    compute are not checked. taken: the checksums a stream took in passing
    (block i is bufs[i]); only the others are computed now."""
    algos = [a for a, _ in expected]
    got = await (checksums(algos, bufs) if taken is None else taken.checksums(algos, bufs))
    bad = [i for i, ((_, want), have) in enumerate(zip(expected, got))
           if have is not None and have != want]
    if bad:
        raise ChecksumError(bad)


class StreamSums:
    """Block checksums computed piece by piece as a stream passes: each piece
    is hashed right after it is copied (landed in the caller's buffer on a
    load, framed on a save), while it is still in cache, instead of in one
    pass over every block after the stream, which reads them back from
    memory (5-15% of a streamed load or save of 256 KiB-4 MiB blocks here).
    A block's first piece (offset 0) names its algorithm, as the daemon
    sends it; a block whose pieces come out of order, or with an algorithm
    this process cannot compute, is hashed at the end instead."""

    __slots__ = ("block_bytes", "done", "_open")

    def __init__(self, block_bytes: int) -> None:
        self.block_bytes = block_bytes
        self.done: Dict[int, Tuple[int, int]] = {}   # index -> (algo, checksum)
        self._open: Dict[int, Tuple[Hasher, int]] = {}   # index -> (state, next offset)

    def piece(self, index: int, offset: int, data: memoryview, algo: int) -> None:
        """Bytes [offset, offset + data.nbytes) of block `index`, as they now
        stand where the caller keeps them; `algo` is the chunk's (set on a
        block's first piece only)."""
        n = data.nbytes
        if offset == 0:
            if algo not in ALGOS:
                return
            if n == self.block_bytes:
                self.done[index] = (algo, ALGOS[algo](data))
                return
            h = Hasher(algo)
            h.feed(data)
            self._open[index] = (h, n)
            return
        state = self._open.pop(index, None)
        if state is None or state[1] != offset:
            return   # out of order: verified at the end
        h, pos = state
        h.feed(data)
        pos += n
        if pos == self.block_bytes:
            self.done[index] = (h.algo, h.digest())
        else:
            self._open[index] = (h, pos)

    async def checksums(self, algos: Sequence[int], bufs: Sequence[Any],
                        indices: Optional[Sequence[int]] = None) -> List[Optional[int]]:
        """As the module's `checksums(algos, bufs)`, bufs[k] being block
        indices[k] (default k): the checksums taken in passing where they
        were taken with that algorithm, the others computed now."""
        out: List[Optional[int]] = []
        rest: List[int] = []
        for k, algo in enumerate(algos):
            got = self.done.get(k if indices is None else indices[k])
            if got is not None and got[0] == algo:
                out.append(got[1])
            else:
                out.append(None)
                rest.append(k)
        if rest:
            later = await checksums([algos[k] for k in rest], [bufs[k] for k in rest])
            for k, v in zip(rest, later):
                out[k] = v
        return out
