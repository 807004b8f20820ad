"""Host-tier arena file: header, extents, copy helpers, lifetime."""
from __future__ import annotations

import os
import stat
import struct

import numpy as np
import pytest

from kvkeeper.server.ledger.pages import PageAllocator, iter_pages
from kvkeeper.server.tiers.arena import (FORMAT_VERSION, HEADER_BYTES, MAGIC, Arena)

PB = 4096


@pytest.fixture
def arena(shm_path):   # shm_path: tests/conftest.py
    a = Arena.create(shm_path, HEADER_BYTES + 16 * PB, PB)
    yield a
    a.close()


def _file_bytes(path: str, off: int, n: int) -> bytes:
    with open(path, "rb") as f:
        f.seek(off)
        return f.read(n)


def test_header_layout(shm_path):
    size = HEADER_BYTES + 10 * 8192 + 100  # tail smaller than a page is unused
    a = Arena.create(shm_path, size, 8192)
    try:
        st = os.stat(shm_path)
        assert st.st_size == size
        assert stat.S_IMODE(st.st_mode) == 0o600
        head = _file_bytes(shm_path, 0, 56)
        assert head[0:8] == MAGIC == b"KVKARENA"
        assert head[8:24] == a.arena_id and len(a.arena_id) == 16
        page_bytes, page_count, data_offset, version = struct.unpack("<QQQQ", head[24:56])
        assert (page_bytes, page_count, data_offset, version) == (8192, 10, HEADER_BYTES, 1)
        assert FORMAT_VERSION == 1 and HEADER_BYTES == 4096
        assert (a.path, a.size_bytes, a.page_bytes, a.page_count, a.data_offset) == \
            (shm_path, size, 8192, 10, HEADER_BYTES)
        # the rest of the header is zero
        assert _file_bytes(shm_path, 56, HEADER_BYTES - 56) == bytes(HEADER_BYTES - 56)
    finally:
        a.close()


def test_arena_ids_are_random(shm_path):
    a = Arena.create(shm_path, HEADER_BYTES + PB, PB)
    first = a.arena_id
    a.close()
    b = Arena.create(shm_path, HEADER_BYTES + PB, PB)
    try:
        assert b.arena_id != first
    finally:
        b.close()


def test_file_is_sparse(shm_path):
    size = HEADER_BYTES + 4096 * PB  # 16 MiB
    a = Arena.create(shm_path, size, PB)
    try:
        assert os.stat(shm_path).st_blocks * 512 < size // 4
    finally:
        a.close()


def test_create_replaces_existing_file(shm_path):
    with open(shm_path, "wb") as f:
        f.write(b"junk" * 100_000)
    os.chmod(shm_path, 0o644)
    a = Arena.create(shm_path, HEADER_BYTES + 2 * PB, PB)
    try:
        st = os.stat(shm_path)
        assert st.st_size == HEADER_BYTES + 2 * PB
        assert stat.S_IMODE(st.st_mode) == 0o600
        assert _file_bytes(shm_path, 0, 8) == MAGIC
        assert _file_bytes(shm_path, HEADER_BYTES, 2 * PB) == bytes(2 * PB)
    finally:
        a.close()


@pytest.mark.parametrize("page_bytes", [0, -4096, 1000, 4097, 6144])
def test_create_rejects_bad_page_bytes(shm_path, page_bytes):
    with pytest.raises(ValueError, match="multiple of 4096"):
        Arena.create(shm_path, HEADER_BYTES + 64 * PB, page_bytes)
    assert not os.path.exists(shm_path)


@pytest.mark.parametrize("size", [0, HEADER_BYTES, HEADER_BYTES + PB - 1])
def test_create_rejects_size_without_a_page(shm_path, size):
    with pytest.raises(ValueError, match="no page"):
        Arena.create(shm_path, size, PB)
    assert not os.path.exists(shm_path)


def test_extents_contiguous(arena):
    d = arena.data_offset
    assert arena.extents(3, 4, 4 * PB) == [(d + 3 * PB, 4 * PB)]
    assert arena.extents(3, 4, 3 * PB + 100) == [(d + 3 * PB, 3 * PB + 100)]
    assert arena.extents(0, 1, 1) == [(d, 1)]
    assert arena.extents(15, 1, PB) == [(d + 15 * PB, PB)]


def test_extents_fragmented(arena):
    d = arena.data_offset
    pages = (5, 6, 2, 9, 10)
    assert arena.extents(pages, 5, 5 * PB) == [(d + 5 * PB, 2 * PB), (d + 2 * PB, PB),
                                                (d + 9 * PB, 2 * PB)]
    # trimmed inside the last run
    assert arena.extents(pages, 5, 4 * PB + 1) == [(d + 5 * PB, 2 * PB), (d + 2 * PB, PB),
                                                    (d + 9 * PB, PB + 1)]
    # trimmed so that the last run is not needed at all
    assert arena.extents(pages, 5, 3 * PB) == [(d + 5 * PB, 2 * PB), (d + 2 * PB, PB)]
    # a descending tuple is one run per page
    assert arena.extents((4, 3), 2, 2 * PB) == [(d + 4 * PB, PB), (d + 3 * PB, PB)]


def test_run_offsets_are_the_extents_of_single_runs(arena):
    d = arena.data_offset
    last = arena.page_count - 4
    got = arena.run_offsets([3, None, 0, last], 4, 3 * PB + 1)
    assert got == [d + 3 * PB, None, d, d + last * PB]
    for p, off in zip([3, 0, last], [got[0], got[2], got[3]]):
        assert arena.extents(p, 4, 3 * PB + 1) == [(off, 3 * PB + 1)]
    assert arena.run_offsets([], 1, PB) == [] and arena.run_offsets([None], 1, PB) == [None]


@pytest.mark.parametrize("pages,n_pages,nbytes", [
    ([(5, 6, 2, 9)], 4, 4 * PB),    # fragmented: a tuple of pages (extents() answers it)
    ([0, (5, 6)], 2, 2 * PB),       # one of several
    ([13], 4, 4 * PB),              # past the last page
    ([-1], 1, PB),
    (["3"], 1, PB),                 # not a page number
    ([0], 4, 4 * PB + 1),           # more bytes than the pages hold
    ([0], 0, 1),
    ([0], 1, 0),
])
def test_run_offsets_leave_everything_else_to_extents(arena, pages, n_pages, nbytes):
    assert arena.run_offsets(pages, n_pages, nbytes) is None


def test_extents_match_allocator_pages(arena):
    alloc = PageAllocator(arena.page_count)
    a = alloc.alloc(3)
    b = alloc.alloc(4)
    alloc.alloc(2)
    alloc.free(a, 3)
    alloc.free(b, 4)
    # freed runs come back in LIFO order: a fragmented 6-page block
    pages = alloc.alloc(6)
    assert isinstance(pages, tuple)
    nbytes = 5 * PB + 17
    ext = arena.extents(pages, 6, nbytes)
    assert sum(n for _, n in ext) == nbytes
    # byte i of the block lives in page list[i // PB] at i % PB
    plist = list(iter_pages(pages, 6))
    covered = []
    for off, n in ext:
        assert (off - arena.data_offset) % PB == 0
        first = (off - arena.data_offset) // PB
        covered.extend(range(first, first + -(-n // PB)))
    assert covered == plist[:len(covered)] and len(covered) == 6


def test_extents_rejects_bad_arguments(arena):
    with pytest.raises(ValueError):
        arena.extents(0, 2, 2 * PB + 1)
    with pytest.raises(ValueError):
        arena.extents(0, 2, -1)
    with pytest.raises(ValueError, match="out of range"):
        arena.extents(15, 2, PB)
    with pytest.raises(ValueError, match="out of range"):
        arena.extents((1, 16), 2, PB)  # validated even where not needed for nbytes
    with pytest.raises(ValueError):
        arena.extents((1, 2, 3), 2, PB)
    with pytest.raises(ValueError):
        arena.extents(0, 0, 0)


def test_write_read_round_trip_across_extents(arena):
    rng = np.random.default_rng(1)
    pages = (7, 8, 1, 12, 13, 14)
    nbytes = 5 * PB + 1234
    ext = arena.extents(pages, 6, nbytes)
    assert len(ext) == 3
    data = rng.integers(0, 256, nbytes, dtype=np.uint8).tobytes()
    arena.write(ext, data)
    assert arena.read(ext) == data
    out = bytearray(nbytes)
    arena.read_into(ext, out)
    assert out == data
    arr = np.empty(nbytes, np.uint8)
    arena.read_into(ext, arr)
    assert arr.tobytes() == data
    # the bytes really are at the extents' file offsets
    pos = 0
    for off, n in ext:
        assert _file_bytes(arena.path, off, n) == data[pos:pos + n]
        pos += n


def test_write_accepts_typed_buffers(arena):
    ext = arena.extents((3, 0), 2, 2 * PB)
    src = np.arange(PB, dtype=np.float16)  # 2 bytes each: 2 pages
    arena.write(ext, src)
    back = np.empty(PB, np.float16)
    arena.read_into(ext, back)
    assert np.array_equal(back, src)
    big_endian = np.arange(2 * PB // 4, dtype=">f4")  # a format memoryview.cast refuses
    arena.write(ext, big_endian)
    assert arena.read(ext) == big_endian.tobytes()


def test_write_with_start_crosses_extents(arena):
    ext = arena.extents((2, 6, 4), 3, 3 * PB)
    arena.write(ext, bytes(3 * PB))
    chunk = bytes(range(200)) * 2
    arena.write(ext, chunk, start=PB - 150)  # crosses page 2 -> page 6
    expect = bytearray(3 * PB)
    expect[PB - 150:PB - 150 + len(chunk)] = chunk
    assert arena.read(ext) == bytes(expect)
    # chunk by chunk, as the streaming path writes, covering every extent boundary
    data = os.urandom(3 * PB)
    for start in range(0, 3 * PB, 1000):
        arena.write(ext, data[start:start + 1000], start=start)
    assert arena.read(ext) == data
    arena.write(ext, b"", start=3 * PB)  # empty write at the end is fine


def test_write_and_read_into_reject_wrong_sizes(arena):
    ext = arena.extents(0, 2, PB + 10)
    with pytest.raises(ValueError, match="overruns"):
        arena.write(ext, bytes(PB + 11))
    with pytest.raises(ValueError, match="overruns"):
        arena.write(ext, bytes(10), start=PB + 1)
    with pytest.raises(ValueError, match="overruns"):
        arena.write(ext, b"x", start=-1)
    with pytest.raises(ValueError):
        arena.read_into(ext, bytearray(PB + 9))
    with pytest.raises(ValueError, match="read-only"):
        arena.read_into(ext, bytes(PB + 10))
    with pytest.raises(ValueError):
        arena.write(ext, "not bytes")


def test_extents_outside_data_region_are_refused(arena):
    with pytest.raises(ValueError, match="data region"):
        arena.write([(0, 8)], b"CLOBBERS")  # the header
    with pytest.raises(ValueError, match="data region"):
        arena.read([(arena.size_bytes - 4, 8)])
    with pytest.raises(ValueError, match="data region"):
        arena.view(arena.size_bytes, 1)
    assert _file_bytes(arena.path, 0, 8) == MAGIC


def test_view_is_zero_copy(arena):
    (off, n), = arena.extents(5, 1, PB)
    v = arena.view(off, n)
    assert not v.readonly and v.nbytes == PB
    v[:4] = b"abcd"
    assert arena.read([(off, 4)]) == b"abcd"
    arena.write([(off, n)], b"z" * PB)
    assert bytes(v[:2]) == b"zz"
    v.release()


def test_close_unlinks_and_is_idempotent(shm_path):
    a = Arena.create(shm_path, HEADER_BYTES + PB, PB)
    assert os.path.exists(shm_path)
    a.close()
    assert a.closed and not os.path.exists(shm_path)
    a.close()
    with pytest.raises(ValueError, match="closed"):
        a.read([(HEADER_BYTES, 1)])


def test_close_without_unlink_keeps_file(shm_path):
    a = Arena.create(shm_path, HEADER_BYTES + PB, PB)
    a.close(unlink=False)
    assert os.path.exists(shm_path)
    a.close()  # already closed: does nothing, even unlink
    assert os.path.exists(shm_path)


def test_close_with_live_views_does_not_raise(shm_path):
    a = Arena.create(shm_path, HEADER_BYTES + 2 * PB, PB)
    v = a.view(HEADER_BYTES, PB)
    a.close()
    assert not os.path.exists(shm_path)
    v[0] = 7  # the mapping survives while the view does
    assert v[0] == 7
    with pytest.raises(ValueError, match="closed"):
        a.view(HEADER_BYTES, PB)
    del v


def test_close_leaves_a_replacement_file_alone(shm_path):
    old = Arena.create(shm_path, HEADER_BYTES + PB, PB)
    new = Arena.create(shm_path, HEADER_BYTES + PB, PB)  # a restarted daemon
    try:
        old.close()
        assert os.path.exists(shm_path)
        assert _file_bytes(shm_path, 8, 16) == new.arena_id
    finally:
        new.close()
    assert not os.path.exists(shm_path)


def _at_page_offset(raw: np.ndarray, page_offset: int, n: int) -> np.ndarray:
    start = (page_offset - raw.ctypes.data) % 4096
    out = raw[start:start + n]
    assert out.ctypes.data % 4096 == page_offset and out.nbytes == n
    return out


@pytest.mark.parametrize("page_offset", [0, 8, 16, 31, 32, 4080])
def test_copies_at_every_relative_alignment(arena, page_offset):
    # both copy paths (memmove, and the ufunc one that avoids page aliasing)
    n = 2 * PB + 2500
    ext = arena.extents((3, 8, 9), 3, n)
    raw = np.zeros(n + 8192, np.uint8)
    data = np.random.default_rng(page_offset).integers(0, 256, n, dtype=np.uint8)
    src = _at_page_offset(raw, page_offset, n)
    src[:] = data
    arena.write(ext, src[:5000])
    arena.write(ext, memoryview(src[5000:]).toreadonly(), start=5000)
    assert arena.read(ext) == data.tobytes()
    raw[:] = 0
    dst = _at_page_offset(raw, page_offset, n)
    arena.read_into(ext, dst)
    assert np.array_equal(dst, data)
    assert int(raw.sum()) == int(data.sum())  # nothing written outside dst


def test_prefault_says_when_the_directory_has_no_room(shm_path, monkeypatch):
    """EFAULT from MADV_POPULATE_WRITE is the SIGBUS a write would have
    taken: a clear error naming the size and the fix; a kernel without
    populate falls back to allocating the file's blocks."""
    import errno

    from kvkeeper.server.tiers import arena as arena_mod

    class Mm:
        def __init__(self, err):
            self.err = err

        def madvise(self, *a):
            raise OSError(self.err, "x")

    fd = os.open(shm_path, os.O_RDWR | os.O_CREAT, 0o600)
    try:
        with pytest.raises(arena_mod.ArenaSpaceError, match="needs 1.00 GiB in .*--shm-size"):
            arena_mod.prefault(Mm(errno.EFAULT), fd, shm_path, 1 << 30)
        os.ftruncate(fd, 64 * PB)
        assert arena_mod.prefault(Mm(errno.EINVAL), fd, shm_path, 64 * PB) == "allocated"
        assert os.fstat(fd).st_blocks * 512 >= 64 * PB
        monkeypatch.setattr(arena_mod.os, "posix_fallocate",
                            lambda *a: (_ for _ in ()).throw(OSError(errno.ENOSPC, "full")))
        with pytest.raises(arena_mod.ArenaSpaceError, match="host_tier.capacity_bytes"):
            arena_mod.prefault(Mm(errno.EINVAL), fd, shm_path, 64 * PB)
    finally:
        os.close(fd)


async def test_a_daemon_whose_arena_does_not_fit_refuses_to_start(daemon_config, monkeypatch):
    """The start fails as a configuration error on host_tier.capacity_bytes
    (exit status 2), and leaves no arena file behind."""
    import errno

    from kvkeeper.server.app import create_server
    from kvkeeper.server.config import ConfigError
    from kvkeeper.server.tiers import arena as arena_mod

    def full(mm, fd, path, size, progress=None):
        raise arena_mod.ArenaSpaceError(errno.ENOSPC, f"the host tier's arena needs {size} B")

    monkeypatch.setattr(arena_mod, "prefault", full)
    cfg = daemon_config(**{"host_tier.name": f"kvk-nofit-{os.getpid()}"})
    with pytest.raises(ConfigError, match="arena needs") as info:
        create_server(cfg)
    assert info.value.key == "host_tier.capacity_bytes"
    assert not os.path.exists(os.path.join(cfg.host_tier.shm_dir, cfg.host_tier.name))
    cfg = daemon_config(**{"host_tier.name": f"kvk-nofit-{os.getpid()}",
                           "host_tier.prefault": False})
    daemon, _ = create_server(cfg)    # not asked to prefault: starts
    await daemon.start()
    await daemon.stop(0)


@pytest.mark.skipif(tuple(int(x) for x in __import__("re").findall(r"\d+", os.uname().release)[:2])
                    < (5, 14), reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_prefault_reports_its_progress(shm_path, monkeypatch):
    from kvkeeper.server.tiers import arena as arena_mod

    monkeypatch.setattr(arena_mod, "POPULATE_STEP", 16 * PB)
    done = []
    a = Arena.create(shm_path, HEADER_BYTES + 40 * PB, PB, prefault_pages=True,
                     progress=done.append)
    try:
        assert done == [16 * PB, 32 * PB, a.size_bytes]
        assert os.stat(shm_path).st_blocks * 512 >= a.size_bytes
    finally:
        a.close()
