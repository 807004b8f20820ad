"""Same-host block copies with their checksums: a lease's blocks out of the
arena, verified, and a reservation's blocks into it, checksummed.

Each checksum is computed inside its block's copy (ArenaMapping.read_block and
write_block with a Hasher's feed): piece by piece, each piece hashed right
after it is copied, while it is still in cache. Copying everything and then
hashing it read every byte from memory twice (~0.5x memcpy with XXH3-64 in
`kvkeeper bench data`).

A load checks the bytes it copied into the caller's buffer, which are exactly
the bytes the caller is about to use; a save checksums the caller's bytes as
it copies them, so a copy gone wrong is caught by the next load rather than
blessed. Large batches run off the event loop (`load_verified`, `save_summed`),
and larger ones in shards on several threads at once.
"""
from __future__ import annotations

import asyncio
import contextvars
import functools
import os
from typing import Any, Callable, List, Optional, Sequence, Tuple, TypeVar

import numpy as np

from kvkeeper.v1 import kvkeeper_pb2 as pb

from .arena_format import Extent
from .arena_mapping import ArenaMapping
from .checksum import ALGOS, OFFLOAD_BYTES, Hasher

__all__ = ["Stored", "extents_of", "stored", "read_verified", "write_summed", "load_verified",
           "save_summed", "copy_threads", "shards"]


T = TypeVar("T")

Stored = Tuple[int, int, List[Extent]]
"""A block to load: (checksum_algo, checksum, extents), from `stored`."""


def extents_of(msg: Any) -> List[Extent]:
    """A protobuf Extent list (BlockRef.extents, SaveSlot.extents) as plain
    (offset, length) tuples. Read each message once, through this: the
    protobuf runtime answers a second pass over the same fields several
    times slower (its wrappers were dropped after the first)."""
    return [(e.offset, e.length) for e in msg]


def stored(refs: Sequence[pb.BlockRef]) -> List[Stored]:
    """(checksum_algo, checksum, extents) of each ref, read once."""
    return [(r.checksum_algo, r.checksum, extents_of(r.extents)) for r in refs]


def _u8(buf: Any) -> np.ndarray:
    """A flat byte view (checks.block_views') as a uint8 array, without copying."""
    return np.frombuffer(buf, dtype=np.uint8)


def read_verified(m: ArenaMapping, blocks: Sequence[Stored], outs: Sequence[Any],
                  verifies: bool) -> List[int]:
    """Copy each block (as `stored` gives it) into outs[i] (flat byte views
    of exactly a block); with `verifies`, check each against the checksum it
    was committed with, and return the indices that differ (in order; blocks
    stored without a checksum, or with one this process cannot compute, are
    not checked). Every block is copied either way: the caller must not use
    any of `outs` when the answer is not empty."""
    read = m.read_block
    if not verifies:
        for (_, _, ext), out in zip(blocks, outs):
            read(ext, _u8(out))
        return []
    bad: List[int] = []
    for i, ((algo, want, ext), out) in enumerate(zip(blocks, outs)):
        if algo in ALGOS:
            h = Hasher(algo)
            read(ext, _u8(out), h.feed)
            if h.digest() != want:
                bad.append(i)
        else:
            read(ext, _u8(out))
    return bad


def write_summed(m: ArenaMapping, extents: Sequence[List[Extent]], blocks: Sequence[Any],
                 algo: int) -> Optional[List[int]]:
    """Copy blocks[i] (flat byte views of exactly a block) into the arena at
    extents[i] for every i, and return their checksums with `algo` computed
    over the bytes given, or None when algo is CHECKSUM_NONE."""
    write = m.write_block
    if algo == pb.CHECKSUM_NONE:
        for ext, b in zip(extents, blocks):
            write(ext, _u8(b))
        return None
    sums: List[int] = []
    for ext, b in zip(extents, blocks):
        h = Hasher(algo)
        write(ext, _u8(b), h.feed)
        sums.append(h.digest())
    return sums


# A batch this large is split in shards copied at once, each in its own worker
# thread: a copy is bound by one core's memory traffic, not by the memory
# (`kvkeeper bench data` here: 2 threads copy and hash at ~1.5x one thread's
# memcpy). A shard below SHARD_MIN_BYTES gains less than its thread hop costs.
SHARD_MIN_BYTES = 8 << 20
# Past 4 threads the memory, not the cores, is the limit on common servers.
MAX_COPY_THREADS = 4


def copy_threads(requested: int = 0) -> int:
    """Threads a large batch is copied with: `requested`, or with 0 (auto)
    as many CPUs as the calling thread may run on, at most MAX_COPY_THREADS.
    (The connector asks for one per spare core of a CPU engine: worker.py.)"""
    if requested > 0:
        return requested
    try:
        n = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        n = os.cpu_count() or 1
    return max(1, min(n, MAX_COPY_THREADS))


def shards(count: int, nbytes: int, threads: int) -> List[Tuple[int, int]]:
    """[start, end) ranges of a batch of `count` blocks (`nbytes` in all)
    copied by up to copy_threads(threads) threads, each at least
    SHARD_MIN_BYTES; one range when it is not worth splitting."""
    k = min(copy_threads(threads), count, nbytes // SHARD_MIN_BYTES)
    if k <= 1:
        return [(0, count)]
    return [(i * count // k, (i + 1) * count // k) for i in range(k)]


async def load_verified(m: ArenaMapping, blocks: Sequence[Stored], outs: Sequence[Any],
                        verifies: bool, nbytes: int, threads: int = 0) -> List[int]:
    """read_verified of `nbytes` in all (see `batched`)."""
    got = await batched(read_verified, len(blocks), nbytes, threads,
                        lambda a, b: (m, blocks[a:b], outs[a:b], verifies))
    return [a + i for a, bad in got for i in bad]


async def save_summed(m: ArenaMapping, extents: Sequence[List[Extent]], blocks: Sequence[Any],
                      algo: int, nbytes: int, threads: int = 0) -> Optional[List[int]]:
    """write_summed of `nbytes` in all (see `batched`)."""
    got = await batched(write_summed, len(blocks), nbytes, threads,
                        lambda a, b: (m, extents[a:b], blocks[a:b], algo))
    return None if algo == pb.CHECKSUM_NONE else [c for _, sums in got for c in sums or ()]


async def batched(fn: Callable[..., T], count: int, nbytes: int, threads: int,
                  args: Callable[[int, int], Tuple[Any, ...]]) -> List[Tuple[int, T]]:
    """fn(*args(start, end)) over a batch of `count` blocks (`nbytes` in
    all), as (start, answer) per shard: one shard, in a worker thread when
    large (see `off_loop`); several at once, each in a worker thread, when
    larger (see `shards`). Every shard has ended before this returns or
    raises (the first error, once all have): none is left writing into the
    caller's buffers."""
    parts = shards(count, nbytes, threads)
    if len(parts) == 1:
        return [(0, await off_loop(nbytes, fn, *args(0, count)))]
    got = await in_threads([(fn, args(a, b)) for a, b in parts])
    for g in got:
        if isinstance(g, BaseException):
            raise g
    return [(a, g) for (a, _), g in zip(parts, got)]


async def off_loop(nbytes: int, fn: Callable[..., T], *args: Any) -> T:
    """fn(*args), in a worker thread when it moves OFFLOAD_BYTES or more, so
    that one large save or load does not stall heartbeats and other calls
    (the ufunc copies and the hashes drop the GIL); inline when smaller,
    where the thread hop would cost more than it frees.

    A block is copied and hashed by one thread: hashing in a helper thread
    while another copies (tried: pieces handed over a queue) measured
    0.35-0.53x memcpy against 0.65-0.98x fused on a shared 2-core machine.
    Several threads pay where each copies and hashes blocks of its own
    (`shards`)."""
    if nbytes >= OFFLOAD_BYTES:
        (got,) = await in_threads([(fn, args)])
        if isinstance(got, BaseException):
            raise got
        return got  # type: ignore[no-any-return]
    return fn(*args)


async def in_threads(calls: Sequence[Tuple[Callable[..., Any], Tuple[Any, ...]]]) -> List[Any]:
    """Each fn(*args) in a worker thread: their answers, an exception as its
    value. A caller cancelled meanwhile (a deadline, a closed client) is
    cancelled only once every thread has ended: a thread cannot be stopped,
    and one left running would go on writing into buffers the caller reuses
    (a load's) or into arena pages an AbortSave hands to another writer (a
    save's)."""
    loop = asyncio.get_running_loop()
    futs = [loop.run_in_executor(None, functools.partial(
        contextvars.copy_context().run, fn, *args)) for fn, args in calls]
    together = asyncio.gather(*futs, return_exceptions=True)
    try:
        return await asyncio.shield(together)
    except asyncio.CancelledError:
        while not together.done():
            try:
                await asyncio.shield(together)
            except asyncio.CancelledError:
                continue   # cancelled again: still wait for the threads
        raise
