"""One contract, every tier backend: the arena and the disk store pass the same
suite. A new tier's backend joins KINDS and `harness`. (The cluster tier has
no BlockStore of its own: its I/O is asynchronous, not a backend's blocking
calls; tests/server/tiers/cluster/test_cluster_tier.py covers the same ground,
sizes, buffers, overwrite, absence, corruption, against a real server.)"""
from __future__ import annotations

import contextlib
import uuid
from concurrent.futures import ThreadPoolExecutor
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest
import xxhash
from shm_paths import SHM_DIR, unique_shm_path

from kvkeeper.server.ledger.pages import PageAllocator
from kvkeeper.server.ledger.units import ceil_div
from kvkeeper.server.tiers.arena import HEADER_BYTES, Arena
from kvkeeper.server.tiers.backend import ArenaBackend, BlockStore, NotStored, Reach, copy_block
from kvkeeper.server.tiers.disk import DiskStore
from kvkeeper.server.tiers.disk.header import CHECKSUM_XXH3_64
from kvkeeper.server.tiers.disk_tier import DiskBackend

KiB, MiB = 1 << 10, 1 << 20
PAGE = 64 * KiB
ARENA_PAGES = 1024  # 64 MiB, sparse
NS = bytes(range(16))
SIZES = [1, 7, 4095, 4096, 4097, PAGE, 256 * KiB + 5, 1 * MiB, 4 * MiB, 4 * MiB + 1]


class Harness:
    """A backend plus `loc(key, nbytes)`: for the arena it also plays the
    ledger's part, giving each (key, nbytes) its own pages."""

    def __init__(self, backend: Any, pages: PageAllocator | None) -> None:
        self.backend = backend
        self._pages = pages
        self._locs: dict[tuple[bytes, int], Any] = {}

    def loc(self, key: bytes, nbytes: int) -> Any:
        if (key, nbytes) not in self._locs:
            pages = None
            if self._pages is not None:
                pages = self._pages.alloc(ceil_div(nbytes, PAGE))
            self._locs[(key, nbytes)] = self.backend.locate(NS, key, nbytes, pages)
        return self._locs[(key, nbytes)]


KINDS = ["arena", "disk"]


@contextlib.contextmanager
def harness(kind: str, tmp_path: Any) -> Iterator[Harness]:
    if kind == "arena":
        path = unique_shm_path(SHM_DIR or str(tmp_path))
        arena = Arena.create(path, HEADER_BYTES + ARENA_PAGES * PAGE, PAGE)
        try:
            yield Harness(ArenaBackend(arena), PageAllocator(ARENA_PAGES))
        finally:
            arena.close()
    else:
        store, _ = DiskStore.open(str(tmp_path / f"disk-{uuid.uuid4().hex[:8]}"),
                                  owner_id="contract", fsync=False)
        yield Harness(DiskBackend(store), None)


@pytest.fixture(params=KINDS)
def h(request, tmp_path):
    with harness(request.param, tmp_path) as one:
        yield one


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def rand(n: int, seed: int = 0) -> bytes:
    return np.random.default_rng(seed + n).integers(0, 256, n, dtype=np.uint8).tobytes()


def test_fits_the_protocol(h):
    b = h.backend
    assert isinstance(b, BlockStore)
    assert isinstance(b.name, str) and isinstance(b.persistent, bool)
    assert isinstance(b.tracks_presence, bool)
    assert b.reach in (Reach.EXTENTS, Reach.STREAM, Reach.FILES)


def test_capacity_and_usage(h):
    b = h.backend
    assert b.capacity_bytes > 0 and 0 <= b.used_bytes() <= b.capacity_bytes
    before = b.used_bytes()
    n = PAGE + 9
    b.write(h.loc(key(20), n), rand(n))
    if b.tracks_presence:
        assert b.used_bytes() >= before + n
    else:
        assert b.used_bytes() == before   # the ledger counts the arena's pages


def test_contains(h):
    b = h.backend
    n = 2 * PAGE
    loc = h.loc(key(21), n)
    if not b.tracks_presence:
        assert b.contains(loc) is None    # presence is the ledger's
        return
    assert b.contains(loc) is False
    b.write(loc, rand(n))
    assert b.contains(loc) is True
    b.discard(loc)
    assert b.contains(loc) is False


@pytest.mark.parametrize("n", [100, PAGE, 3 * PAGE + 1])
def test_a_view_is_the_block(h, n):
    loc = h.loc(key(22), n)
    h.backend.write(loc, rand(n))
    v = h.backend.view(loc)
    if v is None:
        return  # not one piece of memory: bytes are copied in and out
    assert len(v) == n and bytes(v) == rand(n)
    v[:] = rand(n, 5)
    out = bytearray(n)
    h.backend.read_into(loc, out)
    assert out == rand(n, 5)
    del v


@pytest.mark.parametrize("src_kind", KINDS)
@pytest.mark.parametrize("dst_kind", KINDS)
@pytest.mark.parametrize("n", [1, PAGE + 1, 3 * PAGE])
def test_copy_block_between_any_two_tiers(tmp_path, src_kind, dst_kind, n):
    with harness(src_kind, tmp_path) as src, harness(dst_kind, tmp_path) as dst:
        sloc, dloc = src.loc(key(23), n), dst.loc(key(23), n)
        src.backend.write(sloc, rand(n, 7))
        copy_block(src.backend, sloc, dst.backend, dloc, n)
        out = bytearray(n)
        dst.backend.read_into(dloc, out)
        assert out == rand(n, 7)


@pytest.mark.parametrize("n", SIZES)
def test_round_trip(h, n):
    data = rand(n)
    loc = h.loc(key(1), n)
    assert h.backend.write(loc, data) >= n
    out = bytearray(n)
    h.backend.read_into(loc, out)
    assert out == data


@pytest.mark.parametrize("make", [bytes, bytearray, memoryview,
                                  lambda d: np.frombuffer(d, dtype=np.uint8)],
                         ids=["bytes", "bytearray", "memoryview", "numpy"])
def test_any_buffer_in_and_out(h, make: Callable[[bytes], Any]):
    n = 3 * PAGE + 17
    data = rand(n, 1)
    loc = h.loc(key(2), n)
    h.backend.write(loc, make(data))
    out = np.empty(n, dtype=np.uint8)
    h.backend.read_into(loc, out)
    assert out.tobytes() == data
    halves = np.empty(n // 2, dtype=np.uint16)  # another item size: bytes all the same
    loc2 = h.loc(key(3), halves.nbytes)
    h.backend.write(loc2, np.arange(n // 2, dtype=np.uint16))
    h.backend.read_into(loc2, halves)
    assert np.array_equal(halves, np.arange(n // 2, dtype=np.uint16))


def test_overwrite_replaces(h):
    n = PAGE + 1
    loc = h.loc(key(4), n)
    h.backend.write(loc, rand(n, 1))
    h.backend.write(loc, rand(n, 2))
    out = bytearray(n)
    h.backend.read_into(loc, out)
    assert out == rand(n, 2)


@pytest.mark.parametrize("delta", [-1, 1])
def test_wrong_sizes_raise_and_change_nothing(h, delta):
    n = 2 * PAGE
    loc = h.loc(key(5), n)
    h.backend.write(loc, rand(n))
    with pytest.raises(ValueError):
        h.backend.read_into(loc, bytearray(n + delta))
    with pytest.raises(ValueError):
        h.backend.write(loc, rand(n + delta, 9))
    out = bytearray(n)
    h.backend.read_into(loc, out)
    assert out == rand(n)


def test_bad_buffers_and_locations_raise(h):
    n = 100
    loc = h.loc(key(6), n)
    h.backend.write(loc, rand(n))
    with pytest.raises(ValueError):
        h.backend.read_into(loc, bytes(n))                      # read-only
    with pytest.raises(ValueError):
        h.backend.write(loc, np.zeros((n, 2), np.uint8)[:, 0])  # not contiguous
    for ns, k in [(b"short", key(1)), (NS, b"k"), (NS, "0" * 32), ("0" * 16, key(1)),
                  (NS, bytes(65))]:
        with pytest.raises(ValueError):
            h.backend.locate(ns, k, n, 0 if h._pages is not None else None)
    with pytest.raises(ValueError):
        h.backend.locate(NS, key(1), 0, 0 if h._pages is not None else None)


def test_discard(h):
    n = PAGE + 3
    loc = h.loc(key(7), n)
    h.backend.write(loc, rand(n))
    freed = h.backend.discard(loc)
    out = bytearray(n)
    if h.backend.tracks_presence:
        assert freed >= n
        with pytest.raises(NotStored):
            h.backend.read_into(loc, out)
        assert h.backend.discard(loc) == 0  # twice is fine
        with pytest.raises(NotStored):
            h.backend.read_into(h.loc(key(999), n), out)  # never written
    else:
        # The arena frees nothing itself: the ledger reuses the pages.
        assert freed == 0
    h.backend.write(loc, rand(n, 3))  # the location is usable again
    h.backend.read_into(loc, out)
    assert out == rand(n, 3)


def test_threads_on_different_keys(h):
    sizes = [1, 4096, PAGE - 1, PAGE + 1, 256 * KiB, 1 * MiB + 1]
    jobs = [(i, sizes[i % len(sizes)]) for i in range(48)]
    locs = {i: h.loc(key(100 + i), n) for i, n in jobs}  # the ledger allocates serially

    def one(job: tuple[int, int]) -> bool:
        i, n = job
        ok = True
        for rnd in range(3):
            h.backend.write(locs[i], rand(n, i * 10 + rnd))
            out = bytearray(n)
            h.backend.read_into(locs[i], out)
            ok &= out == rand(n, i * 10 + rnd)
        return ok

    with ThreadPoolExecutor(8) as ex:
        assert all(ex.map(one, jobs))
    for i, n in jobs:  # nothing leaked into a neighbour
        out = bytearray(n)
        h.backend.read_into(locs[i], out)
        assert out == rand(n, i * 10 + 2)


def _split(n: int, seed: int) -> list[int]:
    """Uneven piece sizes adding up to n (as a block's extents might be)."""
    rng = np.random.default_rng(seed)
    cuts = sorted(set(rng.integers(1, n, min(n - 1, 5)).tolist())) if n > 1 else []
    edges = [0, *cuts, n]
    return [b - a for a, b in zip(edges, edges[1:])]


@pytest.mark.parametrize("n", [1, 4097, 3 * PAGE + 1, 4 * MiB + 1])
def test_a_scatter_read_fills_the_pieces_in_order(h, n):
    data = rand(n, 3)
    loc = h.loc(key(30), n)
    h.backend.write(loc, data)
    whole = bytearray(n)
    kept = h.backend.read_into(loc, whole)
    outs = [bytearray(k) for k in _split(n, n)]
    assert h.backend.read_into(loc, outs) == kept
    assert b"".join(outs) == data


@pytest.mark.parametrize("delta", [-1, 1])
def test_a_scatter_read_of_another_total_raises_and_writes_nothing(h, delta):
    n = 2 * PAGE + 3
    loc = h.loc(key(31), n)
    h.backend.write(loc, rand(n))
    outs = [bytearray(b"\x07" * k) for k in _split(n + delta, 4)]
    with pytest.raises(ValueError):
        h.backend.read_into(loc, outs)
    assert all(o == b"\x07" * len(o) for o in outs)


@pytest.mark.parametrize("n", [1, 4097, 3 * PAGE + 1, 4 * MiB + 1])
def test_a_gathered_write_stores_the_pieces_in_order(h, n):
    data = rand(n, 5)
    loc = h.loc(key(34), n)
    pieces, off = [], 0
    for k in _split(n, n + 1):
        pieces.append(data[off:off + k])
        off += k
    assert h.backend.write(loc, pieces) >= n
    out = bytearray(n)
    h.backend.read_into(loc, out)
    assert out == data


@pytest.mark.parametrize("delta", [-1, 1])
def test_a_gathered_write_of_another_total_raises_and_changes_nothing(h, delta):
    n = 2 * PAGE + 3
    loc = h.loc(key(35), n)
    h.backend.write(loc, rand(n))
    with pytest.raises(ValueError):
        h.backend.write(loc, [rand(k, 6) for k in _split(n + delta, 5)])
    out = bytearray(n)
    h.backend.read_into(loc, out)
    assert out == rand(n)


@pytest.mark.parametrize("n", [100, 3 * PAGE + 1])
def test_views_are_the_blocks_pieces(h, n):
    loc = h.loc(key(32), n)
    h.backend.write(loc, rand(n))
    views = h.backend.views(loc)
    if views is None:
        assert h.backend.view(loc) is None   # not in memory at all
        return
    assert b"".join(bytes(v) for v in views) == rand(n)
    new = rand(n, 9)
    off = 0
    for v in views:
        v[:] = new[off:off + len(v)]
        off += len(v)
    out = bytearray(n)
    h.backend.read_into(loc, out)
    assert out == new
    del views


def test_copy_block_fills_a_fragmented_arena_block_in_place(tmp_path, monkeypatch):
    """A disk block promoted into arena pages that are not one run is read
    straight into them (a scatter read), with no buffer in between."""
    n = 3 * PAGE + 5
    with harness("disk", tmp_path) as src, harness("arena", tmp_path) as dst:
        sloc = src.loc(key(33), n)
        src.backend.write(sloc, rand(n, 2))
        dloc = dst.backend.locate(NS, key(33), n, [8, 3, 5, 20])   # four runs
        assert len(dloc.extents) == 4 and dst.backend.view(dloc) is None
        seen = []
        real = DiskBackend.read_into

        def spy(self, loc, out):
            seen.append(type(out))
            return real(self, loc, out)

        monkeypatch.setattr(DiskBackend, "read_into", spy)
        kept = copy_block(src.backend, sloc, dst.backend, dloc, n)
        assert seen == [list] and kept is not None
        out = bytearray(n)
        dst.backend.read_into(dloc, out)
        assert out == rand(n, 2)


@pytest.mark.parametrize("committed", [False, True])
def test_copy_block_writes_a_fragmented_arena_block_from_its_pages(tmp_path, monkeypatch,
                                                                   committed):
    """A flush or demotion of an arena block whose pages are not one run hands
    the disk its pages as they are (a gathered write), with no buffer in
    between; the committed checksum goes with them, else the disk hashes the
    pieces as one payload."""
    n = 3 * PAGE + 5
    want = (CHECKSUM_XXH3_64, xxhash.xxh3_64_intdigest(rand(n, 4)))
    with harness("arena", tmp_path) as src, harness("disk", tmp_path) as dst:
        sloc = src.backend.locate(NS, key(36), n, [8, 3, 5, 20])   # four runs
        assert len(sloc.extents) == 4 and src.backend.view(sloc) is None
        src.backend.write(sloc, rand(n, 4))
        dloc = dst.loc(key(36), n)
        seen = []
        real = DiskBackend.write

        def spy(self, loc, data, checksum=None):
            seen.append((type(data), checksum))
            return real(self, loc, data, checksum)

        monkeypatch.setattr(DiskBackend, "write", spy)
        checksum = want if committed else None
        assert copy_block(src.backend, sloc, dst.backend, dloc, n, checksum) is None
        assert seen == [(list, checksum)]
        out = bytearray(n)
        assert dst.backend.read_into(dloc, out) == want
        assert out == rand(n, 4)
