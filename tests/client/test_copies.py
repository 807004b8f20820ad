"""Same-host block copies with their checksums (kvkeeper.client.copies): the
bytes land where they belong, the checksums equal the one-shot functions over
the caller's bytes, and a corrupted block is reported, on the event loop's
thread or in a worker."""
from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

from kvkeeper.client import copies
from kvkeeper.client.arena_format import PIECE_BYTES
from kvkeeper.client.checksum import OFFLOAD_BYTES, crc32, xxh3_64
from kvkeeper.server.tiers.arena import HEADER_BYTES, Arena
from kvkeeper.v1 import kvkeeper_pb2 as pb

PAGE = 64 << 10
# Blocks of several pages, larger than a piece, split in two extents each.
BLOCK = 2 * PIECE_BYTES + 3 * PAGE
PAGES_PER_BLOCK = -(-BLOCK // PAGE)
N = 4
XXH, CRC, NONE = pb.CHECKSUM_XXH3_64, pb.CHECKSUM_CRC32, pb.CHECKSUM_NONE


@pytest.fixture
def arena(shm_path):   # shm_path and mapping: conftest.py
    a = Arena.create(shm_path, HEADER_BYTES + (N + 1) * PAGES_PER_BLOCK * PAGE, PAGE)
    yield a
    a.close()


def _extents(arena, i):
    """Block i on pages that are not one run: its first page comes last."""
    first = i * PAGES_PER_BLOCK
    pages = tuple(range(first + 1, first + PAGES_PER_BLOCK)) + (first,)
    return arena.extents(pages, PAGES_PER_BLOCK, BLOCK)


def _blocks(seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8) for _ in range(N)]


@pytest.mark.parametrize("algo,fn", [(XXH, xxh3_64), (CRC, crc32)])
def test_write_summed_copies_and_checksums_the_given_bytes(arena, mapping, algo, fn):
    blocks = _blocks()
    exts = [_extents(arena, i) for i in range(N)]
    assert all(len(e) == 2 for e in exts)
    sums = copies.write_summed(mapping, exts, blocks, algo)
    assert sums == [fn(b) for b in blocks]
    assert [arena.read(e) for e in exts] == [b.tobytes() for b in blocks]


def test_write_summed_without_checksum(arena, mapping):
    blocks = _blocks(1)
    exts = [_extents(arena, i) for i in range(N)]
    assert copies.write_summed(mapping, exts, blocks, NONE) is None
    assert [arena.read(e) for e in exts] == [b.tobytes() for b in blocks]


def _saved(arena, mapping, algos):
    """N blocks saved, and their refs as the daemon would hand them out."""
    blocks = _blocks(2)
    exts = [_extents(arena, i) for i in range(N)]
    refs = []
    for e, b, algo in zip(exts, blocks, algos):
        mapping.write(e, b)
        value = {XXH: xxh3_64, CRC: crc32}[algo](b) if algo != NONE else 0
        refs.append(pb.BlockRef(key=b"k", checksum_algo=algo, checksum=value,
                                extents=[pb.Extent(offset=o, length=n) for o, n in e]))
    return blocks, refs


def _flip(arena, ref, at):
    """Flip one byte of the block's bytes in the arena, `at` bytes into the block."""
    for e in ref.extents:
        if at < e.length:
            v = arena.view(e.offset + at, 1)
            v[0] ^= 0x01
            return
        at -= e.length
    raise AssertionError("offset beyond the block")


def test_read_verified_copies_good_blocks_and_names_bad_ones(arena, mapping):
    blocks, refs = _saved(arena, mapping, [XXH, CRC, XXH, NONE])
    outs = [np.zeros(BLOCK, np.uint8) for _ in range(N)]
    stored = copies.stored(refs)
    assert copies.read_verified(mapping, stored, outs, True) == []
    assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))
    # Corrupt the XXH3 block in its last piece and the CRC32 one in its second
    # extent; the block stored without a checksum cannot be checked.
    _flip(arena, refs[0], BLOCK - 1)
    _flip(arena, refs[1], BLOCK - PAGE // 2)
    _flip(arena, refs[3], 5)
    outs = [np.zeros(BLOCK, np.uint8) for _ in range(N)]
    assert copies.read_verified(mapping, stored, outs, True) == [0, 1]
    assert np.array_equal(outs[2], blocks[2])
    # Unverified (checksum="none"), every block is copied as it is.
    assert copies.read_verified(mapping, stored, outs, False) == []
    assert outs[0][-1] == blocks[0][-1] ^ 1


def test_a_wrong_checksum_value_is_reported(arena, mapping):
    _, refs = _saved(arena, mapping, [XXH, XXH, CRC, CRC])
    refs[2].checksum ^= 1 << 31
    outs = [bytearray(BLOCK) for _ in range(N)]
    assert copies.read_verified(mapping, copies.stored(refs), outs, True) == [2]


def test_stored_reads_each_ref_into_plain_tuples():
    ref = pb.BlockRef(checksum_algo=CRC, checksum=7,
                      extents=[pb.Extent(offset=4096, length=10), pb.Extent(offset=0, length=2)])
    assert copies.stored([ref]) == [(CRC, 7, [(4096, 10), (0, 2)])]
    assert copies.extents_of(pb.SaveSlot().extents) == []


async def test_large_batches_give_the_same_answers_off_the_loop(arena, mapping):
    """Past OFFLOAD_BYTES the copies run in a worker thread: the same
    checksums and the same verdicts."""
    blocks, refs = _saved(arena, mapping, [XXH] * N)
    exts = [_extents(arena, i) for i in range(N)]
    stored = copies.stored(refs)
    for nbytes in (BLOCK, OFFLOAD_BYTES):
        assert await copies.save_summed(mapping, exts, blocks, XXH, nbytes) == \
            [xxh3_64(b) for b in blocks]
        outs = [np.zeros(BLOCK, np.uint8) for _ in range(N)]
        assert await copies.load_verified(mapping, stored, outs, True, nbytes) == []
        assert all(np.array_equal(o, b) for o, b in zip(outs, blocks))
    _flip(arena, refs[3], PIECE_BYTES)
    for nbytes in (BLOCK, OFFLOAD_BYTES):
        outs = [np.zeros(BLOCK, np.uint8) for _ in range(N)]
        assert await copies.load_verified(mapping, stored, outs, True, nbytes) == [3]


def test_shards_split_large_batches_by_threads_and_size(monkeypatch):
    mb = copies.SHARD_MIN_BYTES
    assert copies.shards(8, 8 * mb, 1) == [(0, 8)]
    assert copies.shards(8, 8 * mb, 3) == [(0, 2), (2, 5), (5, 8)]
    assert copies.shards(8, 2 * mb - 1, 4) == [(0, 8)]     # a shard would be too small
    assert copies.shards(3, 64 * mb, 4) == [(0, 1), (1, 2), (2, 3)]   # never an empty one
    assert copies.shards(0, 0, 4) == [(0, 0)]
    monkeypatch.setattr(copies.os, "sched_getaffinity", lambda pid: {0, 1, 2, 3, 4, 5, 6, 7})
    assert copies.copy_threads() == copies.MAX_COPY_THREADS
    assert copies.copy_threads(6) == 6
    monkeypatch.setattr(copies.os, "sched_getaffinity", lambda pid: {3})
    assert copies.copy_threads() == 1


@pytest.mark.parametrize("threads", [2, 3, 4])
async def test_sharded_copies_give_the_same_answers(arena, mapping, monkeypatch, threads):
    """Several threads, a shard of the blocks each: the same checksums in
    order, and bad blocks named by their index in the whole batch."""
    monkeypatch.setattr(copies, "SHARD_MIN_BYTES", BLOCK)
    assert len(copies.shards(N, N * BLOCK, threads)) == min(threads, N)
    blocks, refs = _saved(arena, mapping, [XXH, CRC, XXH, CRC])
    exts = [_extents(arena, i) for i in range(N)]
    assert await copies.save_summed(mapping, exts, blocks, XXH, N * BLOCK, threads) == \
        [xxh3_64(b) for b in blocks]
    assert await copies.save_summed(mapping, exts, blocks, NONE, N * BLOCK, threads) is None
    _, refs = _saved(arena, mapping, [XXH, CRC, XXH, CRC])
    stored = copies.stored(refs)
    _flip(arena, refs[1], 3)
    _flip(arena, refs[3], BLOCK - 1)
    outs = [np.zeros(BLOCK, np.uint8) for _ in range(N)]
    assert await copies.load_verified(mapping, stored, outs, True, N * BLOCK, threads) == [1, 3]
    assert np.array_equal(outs[0], blocks[0]) and np.array_equal(outs[2], blocks[2])


async def test_a_failing_shard_raises_after_every_shard_ended(arena, mapping, monkeypatch):
    import time

    monkeypatch.setattr(copies, "SHARD_MIN_BYTES", BLOCK)
    _, refs = _saved(arena, mapping, [XXH] * N)
    stored = copies.stored(refs)
    stored[0] = (XXH, 0, [(0, BLOCK)])          # the header: refused
    ended = []
    real = copies.read_verified

    def slow(m, blocks, outs, verifies):
        try:
            if blocks[0][2][0][0] != 0:
                time.sleep(0.2)                 # the good shard ends well after the bad one
            return real(m, blocks, outs, verifies)
        finally:
            ended.append(blocks[0][2][0][0])

    monkeypatch.setattr(copies, "read_verified", slow)
    outs = [np.zeros(BLOCK, np.uint8) for _ in range(N)]
    with pytest.raises(ValueError, match="outside the data region"):
        await copies.load_verified(mapping, stored, outs, True, N * BLOCK, 2)
    assert len(ended) == 2


@pytest.mark.parametrize("ext", [[(0, BLOCK)], [(HEADER_BYTES, BLOCK - 1)],
                                 [(HEADER_BYTES, BLOCK), (HEADER_BYTES, 1)]],
                         ids=["header", "short", "long"])
def test_extents_outside_the_data_region_or_not_a_block_raise(arena, mapping, ext):
    outs = [np.zeros(BLOCK, np.uint8)]
    with pytest.raises(ValueError, match="outside the data region|extents hold"):
        copies.read_verified(mapping, [(XXH, 0, ext)], outs, True)
    with pytest.raises(ValueError, match="outside the data region|extents hold"):
        copies.write_summed(mapping, [ext], outs, XXH)
    with open(arena.path, "rb") as f:
        assert f.read(8) == b"KVKARENA"   # the header was not written over


def _slow_fill(buf: Any, value: int, started: Any) -> None:
    started.set()
    time.sleep(0.3)
    buf[:] = value


async def test_a_cancelled_copy_returns_only_once_its_threads_have_ended() -> None:
    """A load or save cancelled meanwhile (a deadline, a closed client) must not
    leave a thread writing into buffers its caller now reuses."""
    from kvkeeper.client.copies import in_threads

    bufs = [np.zeros(8, np.uint8) for _ in range(2)]
    started = threading.Event()
    task = asyncio.create_task(in_threads([(_slow_fill, (b, 7, started)) for b in bufs]))
    while not started.is_set():
        await asyncio.sleep(0.01)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert all(b.all() for b in bufs)   # the threads had ended
    for b in bufs:
        b[:] = 0                         # the caller reuses its buffers
    await asyncio.sleep(0.5)
    assert not any(b.any() for b in bufs)


def test_a_blocking_call_past_its_deadline_returns_once_its_threads_have_ended() -> None:
    from kvkeeper.client.copies import in_threads
    from kvkeeper.client.errors import DeadlineExceededError
    from kvkeeper.client.waits import submit, wait_result

    loop = asyncio.new_event_loop()
    t = threading.Thread(target=loop.run_forever, daemon=True)
    t.start()
    try:
        buf = np.zeros(8, np.uint8)
        with pytest.raises(DeadlineExceededError):
            wait_result(submit(in_threads([(_slow_fill, (buf, 9, threading.Event()))]), loop),
                        0.05, "load_into")
        assert buf.all()   # written before the deadline error reached the caller
    finally:
        loop.call_soon_threadsafe(loop.stop)
        t.join(5)
