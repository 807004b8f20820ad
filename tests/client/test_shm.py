"""Client mapping of the host-tier arena, checked against the daemon's Arena."""
from __future__ import annotations

import hashlib
import multiprocessing as mp
import os
import re
import subprocess
import sys
from types import SimpleNamespace

import numpy as np
import pytest
from shm_paths import SHM_DIR, unique_shm_path

from kvkeeper.client.shm import HEADER_BYTES as CLIENT_HEADER_BYTES
from kvkeeper.client.shm import MAGIC as CLIENT_MAGIC
from kvkeeper.client.shm import ShmMapping
from kvkeeper.server.tiers.arena import HEADER_BYTES, MAGIC, Arena
from kvkeeper.v1 import kvkeeper_pb2 as pb

PB = 4096
PAGES = 64
@pytest.fixture
def arena(shm_path):   # shm_path and mapping: conftest.py
    a = Arena.create(shm_path, HEADER_BYTES + PAGES * PB, PB)
    yield a
    a.close()


def test_header_constants_agree_with_daemon():
    assert CLIENT_MAGIC == MAGIC and CLIENT_HEADER_BYTES == HEADER_BYTES


def test_client_module_does_not_import_the_server():
    code = ("import sys, kvkeeper.client.shm; "
            "bad = [m for m in sys.modules if m.startswith('kvkeeper.server')]; "
            "assert not bad, bad")
    subprocess.run([sys.executable, "-c", code], check=True)


def test_attach_reads_the_header(arena, mapping):
    assert mapping.path == arena.path
    assert mapping.size_bytes == arena.size_bytes
    assert mapping.arena_id == arena.arena_id
    assert mapping.page_bytes == PB
    assert mapping.page_count == arena.page_count == PAGES
    assert mapping.data_offset == arena.data_offset == HEADER_BYTES
    assert mapping.still_valid()


def test_attach_accepts_the_proto_message(arena):
    msg = pb.ShmArena(path=arena.path, size_bytes=arena.size_bytes, page_bytes=PB,
                      arena_id=arena.arena_id)
    m = ShmMapping.attach(msg.path, msg.size_bytes, msg.arena_id)
    assert m is not None
    m.close()


def test_attach_rejects_wrong_id(arena):
    other = bytes(b ^ 0xFF for b in arena.arena_id)
    assert ShmMapping.attach(arena.path, arena.size_bytes, other) is None
    assert ShmMapping.attach(arena.path, arena.size_bytes, arena.arena_id[:15]) is None
    assert ShmMapping.attach(arena.path, arena.size_bytes, b"") is None
    assert ShmMapping.attach(arena.path, arena.size_bytes, 16) is None  # not bytes


def test_attach_rejects_wrong_size(arena):
    for size in (arena.size_bytes - 1, arena.size_bytes + PB, 0, -1, HEADER_BYTES):
        assert ShmMapping.attach(arena.path, size, arena.arena_id) is None


def test_attach_rejects_missing_file(tmp_path):
    base = SHM_DIR or str(tmp_path)
    missing = unique_shm_path(base)
    assert ShmMapping.attach(missing, HEADER_BYTES + PB, os.urandom(16)) is None
    assert ShmMapping.attach(os.path.join(missing, "x"), HEADER_BYTES + PB,
                             os.urandom(16)) is None
    assert ShmMapping.attach("", HEADER_BYTES + PB, os.urandom(16)) is None
    assert ShmMapping.attach("bad\0path", HEADER_BYTES + PB, os.urandom(16)) is None


def test_attach_rejects_a_file_that_is_not_an_arena(shm_path):
    size = HEADER_BYTES + PB
    with open(shm_path, "wb") as f:
        f.write(os.urandom(size))
    assert ShmMapping.attach(shm_path, size, os.urandom(16)) is None
    with open(shm_path, "rb") as f:
        fake_id = f.read(24)[8:24]
    assert ShmMapping.attach(shm_path, size, fake_id) is None  # no magic


def test_attach_rejects_a_directory(tmp_path):
    assert ShmMapping.attach(str(tmp_path), HEADER_BYTES + PB, os.urandom(16)) is None


def test_round_trip_with_daemon_side(arena, mapping):
    pages = (10, 11, 3, 40, 41, 42)
    nbytes = 5 * PB + 999
    ext = arena.extents(pages, 6, nbytes)
    data = os.urandom(nbytes)
    mapping.write(ext, data)
    assert arena.read(ext) == data
    data2 = os.urandom(nbytes)
    arena.write(ext, data2)
    assert mapping.read(ext) == data2
    out = bytearray(nbytes)
    mapping.read_into(ext, out)
    assert out == data2


def test_protobuf_and_attribute_extents(arena, mapping):
    ext = arena.extents((5, 6, 1), 3, 3 * PB)
    pb_ext = [pb.Extent(offset=o, length=n) for o, n in ext]
    ns_ext = [SimpleNamespace(offset=o, length=n) for o, n in ext]
    data = os.urandom(3 * PB)
    mapping.write(pb_ext, data)
    assert mapping.read(ext) == data
    assert mapping.read(ns_ext) == data
    block = pb.BlockRef(key=b"k", extents=pb_ext)
    out = np.empty(3 * PB, np.uint8)
    mapping.read_into(block.extents, out)
    assert out.tobytes() == data
    assert [bytes(v) for v in mapping.gather(block.extents)] == \
        [data[:2 * PB], data[2 * PB:]]


def test_read_into_typed_arrays(arena, mapping):
    ext = arena.extents((20, 2, 3), 3, 3 * PB)
    src = np.random.default_rng(0).standard_normal(3 * PB // 2).astype(np.float16)
    mapping.write(ext, src)
    out = np.empty_like(src)
    mapping.read_into(ext, out)
    assert np.array_equal(out.view(np.uint16), src.view(np.uint16))
    out2d = np.empty((3, PB // 2), np.float16)  # any C-contiguous shape
    mapping.read_into(ext, out2d)
    assert out2d.tobytes() == src.tobytes()
    out_be = np.empty(3 * PB // 4, ">f4")  # a format memoryview.cast refuses
    mapping.read_into(ext, out_be)
    assert out_be.tobytes() == src.tobytes()
    mapping.read_into(ext, memoryview(out))


def test_wrong_lengths_raise(arena, mapping):
    ext = arena.extents((1, 5), 2, PB + 100)
    with pytest.raises(ValueError, match="extents hold"):
        mapping.write(ext, bytes(PB + 99))
    with pytest.raises(ValueError, match="extents hold"):
        mapping.write(ext, bytes(PB + 101))
    with pytest.raises(ValueError, match="extents hold"):
        mapping.read_into(ext, bytearray(PB + 101))
    with pytest.raises(ValueError, match="extents hold"):
        mapping.read_into(ext, np.empty(PB, np.uint8))
    with pytest.raises(ValueError, match="read-only"):
        mapping.read_into(ext, bytes(PB + 100))
    with pytest.raises(ValueError, match="contiguous"):
        mapping.read_into(ext, np.empty(2 * PB + 200, np.uint8)[::2])
    with pytest.raises(ValueError, match="bytes-like"):
        mapping.write(ext, "text")
    assert arena.read(ext) == bytes(PB + 100)  # nothing was written


def test_a_client_writes_whole_blocks_only(arena, mapping):
    """The daemon's arena writes streamed chunks at an offset; the client's
    mapping (the same mapping class) writes only whole reserved blocks."""
    ext = arena.extents((1, 5), 2, PB + 100)
    arena.write(ext, b"d" * 10, start=PB)
    with pytest.raises(ValueError, match="extents hold"):
        mapping.write(ext, b"c" * 10, start=PB)
    with pytest.raises(ValueError, match="extents hold"):
        mapping.write(ext, b"c" * (PB + 100), start=1)
    assert arena.read(ext) == bytes(PB) + b"d" * 10 + bytes(90)  # nothing written
    mapping.write(ext, b"c" * (PB + 100))
    assert arena.read(ext) == b"c" * (PB + 100)


def test_extents_outside_the_data_region_raise(arena, mapping):
    with pytest.raises(ValueError, match="data region"):
        mapping.write([(0, 8)], b"CLOBBERS")
    with pytest.raises(ValueError, match="data region"):
        mapping.read([(arena.size_bytes - 1, 2)])
    with pytest.raises(ValueError, match="data region"):
        mapping.gather([(HEADER_BYTES, -1)])
    assert mapping.still_valid()


def test_gather_is_zero_copy(arena, mapping):
    ext = arena.extents((7, 30), 2, 2 * PB)
    views = mapping.gather(ext)
    assert [v.nbytes for v in views] == [PB, PB]
    views[1][:3] = b"xyz"
    assert arena.read(ext)[PB:PB + 3] == b"xyz"
    arena.write(ext, b"q" * (2 * PB))
    assert bytes(views[0][:1]) == b"q"
    for v in views:
        v.release()


def test_still_valid_detects_daemon_restart(shm_path):
    a = Arena.create(shm_path, HEADER_BYTES + PB, PB)
    m = ShmMapping.attach(shm_path, a.size_bytes, a.arena_id)
    assert m is not None and m.still_valid()
    b = Arena.create(shm_path, HEADER_BYTES + PB, PB)  # restarted: same path, new file
    try:
        assert not m.still_valid()
        assert ShmMapping.attach(shm_path, a.size_bytes, a.arena_id) is None
    finally:
        m.close()
        a.close()
        b.close()


def test_still_valid_after_unlink_is_false(arena, mapping):
    arena.close()
    assert not mapping.still_valid()


def test_close_is_idempotent_and_keeps_the_file(arena):
    m = ShmMapping.attach(arena.path, arena.size_bytes, arena.arena_id)
    views = m.gather(arena.extents(0, 1, PB))
    m.close()  # live views: no BufferError
    m.close()
    assert m.closed and not m.still_valid()
    assert os.path.exists(arena.path)
    views[0][0] = 1
    with pytest.raises(ValueError, match="closed"):
        m.read([(HEADER_BYTES, 1)])
    del views


def test_large_block_round_trip(shm_path):
    page = 256 << 10
    a = Arena.create(shm_path, HEADER_BYTES + 40 * page, page)
    m = ShmMapping.attach(shm_path, a.size_bytes, a.arena_id)
    try:
        ext = a.extents((30, 31, 2, 3, 4, 17, 18, 19, 20, 21, 0, 1, 5, 6, 7, 8), 16, 4 << 20)
        data = np.random.default_rng(2).integers(0, 256, 4 << 20, dtype=np.uint8)
        m.write(ext, data)
        out = np.empty_like(data)
        a.read_into(ext, out)
        assert np.array_equal(out, data)
    finally:
        m.close()
        a.close()


# ---- a second process, as a vLLM worker would be

def _pattern(seed: int, n: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def _child(path, size, arena_id, read_ext, write_ext, conn):
    """Runs in a spawned process: attach, check the daemon's bytes, write ours."""
    try:
        m = ShmMapping.attach(path, size, arena_id)
        if m is None:
            conn.send(("error", "attach returned None"))
            return
        nread = sum(n for _, n in read_ext)
        out = np.empty(nread, np.uint8)
        m.read_into(read_ext, out)
        digest = hashlib.sha256(out.tobytes()).hexdigest()
        m.write([pb.Extent(offset=o, length=n) for o, n in write_ext],
                _pattern(7, sum(n for _, n in write_ext)))
        rejected = ShmMapping.attach(path, size, bytes(16)) is None
        m.close()
        conn.send(("ok", digest, rejected))
    except BaseException as e:  # report anything to the parent
        conn.send(("error", repr(e)))
    finally:
        conn.close()


def test_second_process_writes_daemon_reads(arena):
    read_ext = arena.extents((12, 13, 14, 0), 4, 3 * PB + 500)
    write_ext = arena.extents((50, 33, 34, 35), 4, 4 * PB)
    daemon_bytes = _pattern(3, 3 * PB + 500)
    arena.write(read_ext, daemon_bytes)
    ctx = mp.get_context("spawn")
    parent, child = ctx.Pipe(duplex=False)
    p = ctx.Process(target=_child, args=(arena.path, arena.size_bytes, arena.arena_id,
                                         read_ext, write_ext, child))
    p.start()
    child.close()
    try:
        assert parent.poll(60), "child sent nothing"
        msg = parent.recv()
        p.join(30)
    finally:
        if p.is_alive():
            p.kill()
            p.join()
        parent.close()
    assert msg[0] == "ok", msg
    assert msg[1] == hashlib.sha256(daemon_bytes).hexdigest()
    assert msg[2] is True
    assert p.exitcode == 0
    assert arena.read(write_ext) == _pattern(7, 4 * PB)


def _at_page_offset(raw: np.ndarray, page_offset: int, n: int) -> np.ndarray:
    """A slice of `raw` of n bytes whose address is page_offset modulo 4096."""
    start = (page_offset - raw.ctypes.data) % 4096
    out = raw[start:start + n]
    assert out.ctypes.data % 4096 == page_offset and out.nbytes == n
    return out


@pytest.mark.parametrize("page_offset", [0, 1, 8, 16, 31, 32, 63, 64, 2048, 4065, 4080, 4095])
def test_copies_at_every_relative_alignment(arena, mapping, page_offset):
    # Covers both copy paths: memmove, and the ufunc one used where memmove
    # would hit page aliasing (destination 1..63 bytes past the source mod 4 KiB).
    ext = arena.extents((9, 10, 4, 60), 4, 3 * PB + 3000)
    n = 3 * PB + 3000
    raw = np.zeros(n + 8192, np.uint8)
    data = np.random.default_rng(page_offset).integers(0, 256, n, dtype=np.uint8)
    src = _at_page_offset(raw, page_offset, n)
    src[:] = data
    mapping.write(ext, src)
    assert arena.read(ext) == data.tobytes()
    mapping.write(ext, memoryview(src).toreadonly())  # read-only source
    assert arena.read(ext) == data.tobytes()
    raw[:] = 0
    dst = _at_page_offset(raw, page_offset, n)
    mapping.read_into(ext, dst)
    assert np.array_equal(dst, data)
    assert not raw[:dst.ctypes.data - raw.ctypes.data].any()  # nothing outside dst
    assert not raw[dst.ctypes.data - raw.ctypes.data + n:].any()


@pytest.mark.parametrize("page_offset", [0, 1, 16, 63, 64, 2048, 4065, 4095])
def test_block_copies_at_every_relative_alignment(arena, mapping, page_offset, monkeypatch):
    # copy_run (the batch path, checksum fused): right bytes and checksum at
    # every distance, and never a memmove where page aliasing makes it crawl.
    import kvkeeper.client.arena_format as af
    from kvkeeper.client.checksum import Hasher, xxh3_64

    crawling = []
    real_copyto = np.copyto

    def copyto(dst, src):
        if 0 < (dst.ctypes.data - src.ctypes.data) % 4096 < 64 and dst.nbytes >= 2048:
            crawling.append(dst.nbytes)
        real_copyto(dst, src)

    monkeypatch.setattr(af.np, "copyto", copyto)
    monkeypatch.setattr(af, "PIECE_BYTES", 2 * PB)   # several pieces per extent
    n = 3 * PB + 3000
    ext = arena.extents((9, 10, 4, 60), 4, n)
    raw = np.zeros(n + 8192, np.uint8)
    data = np.random.default_rng(page_offset).integers(0, 256, n, dtype=np.uint8)
    src = _at_page_offset(raw, page_offset, n)
    src[:] = data
    h = Hasher(pb.CHECKSUM_XXH3_64)
    mapping.write_block(ext, src, h.feed)
    assert arena.read(ext) == data.tobytes() and h.digest() == xxh3_64(data)
    raw[:] = 0
    dst = _at_page_offset(raw, page_offset, n)
    h = Hasher(pb.CHECKSUM_XXH3_64)
    mapping.read_block(ext, dst, h.feed)
    assert np.array_equal(dst, data) and h.digest() == xxh3_64(data)
    assert not raw[:dst.ctypes.data - raw.ctypes.data].any()  # nothing outside dst
    assert not raw[dst.ctypes.data - raw.ctypes.data + n:].any()
    assert crawling == []


def test_address_hint_matches_numpy():
    # The copy path choice relies on it; a wrong address would only cost speed.
    from kvkeeper.client.arena_format import address as _address
    for obj in (bytes(5000), bytearray(5000), np.zeros(5000, np.uint8),
                memoryview(bytes(5000))[1:], memoryview(np.zeros(5000, np.uint8)).toreadonly()):
        mv = memoryview(obj)
        assert _address(mv) == np.frombuffer(mv, np.uint8).ctypes.data, type(obj)


def _faults_reading(view) -> int:
    """Minor page faults taken while reading `view` (hashing it: no allocation)."""
    import resource

    from kvkeeper.client.checksum import xxh3_64

    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    xxh3_64(view)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before


@pytest.mark.skipif(tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2]) < (5, 14),
                    reason="MADV_POPULATE_READ needs Linux 5.14")
def test_attach_prefaults_the_pages_that_hold_data(shm_path):
    """A fresh mapping faults on its first touch of each page; attach maps the
    written pages at once, and leaves holes unallocated (populating them would
    allocate the whole arena)."""
    pages = 1024
    a = Arena.create(shm_path, HEADER_BYTES + pages * PB, PB)
    try:
        written = 256 * PB
        a.view(HEADER_BYTES, written)[:] = b"\x5a" * written
        allocated = os.stat(shm_path).st_blocks
        cold = ShmMapping.attach(a.path, a.size_bytes, a.arena_id, prefault=False)
        warm = ShmMapping.attach(a.path, a.size_bytes, a.arena_id)
        assert os.stat(shm_path).st_blocks == allocated
        try:
            _faults_reading(b"warm-up")
            warm_faults = _faults_reading(warm.view(HEADER_BYTES, written))
            cold_faults = _faults_reading(cold.view(HEADER_BYTES, written))
            assert cold_faults > 0
            assert warm_faults * 4 < cold_faults
        finally:
            cold.close()
            warm.close()
    finally:
        a.close()


@pytest.mark.skipif(tuple(int(x) for x in re.findall(r"\d+", os.uname().release)[:2]) < (5, 14),
                    reason="MADV_POPULATE_WRITE needs Linux 5.14")
def test_a_prefaulted_arena_is_allocated_and_a_client_maps_every_page(shm_path):
    """host_tier.prefault: the daemon allocates every page at creation; a
    client attaching then maps them all, so even a page no block was ever
    written to reads (and writes) without a fault."""
    pages = 1024
    a = Arena.create(shm_path, HEADER_BYTES + pages * PB, PB, prefault_pages=True)
    try:
        assert os.stat(shm_path).st_blocks * 512 >= a.size_bytes
        cold = ShmMapping.attach(a.path, a.size_bytes, a.arena_id, prefault=False)
        warm = ShmMapping.attach(a.path, a.size_bytes, a.arena_id)
        try:
            _faults_reading(b"warm-up")
            span = (HEADER_BYTES + 512 * PB, 256 * PB)   # never written by anyone
            assert _faults_reading(cold.view(*span)) > 0
            assert _faults_reading(warm.view(*span)) == 0
        finally:
            cold.close()
            warm.close()
    finally:
        a.close()


# ---- gather_readonly: the loads' views of many blocks at once

def test_views_are_the_blocks_bytes_and_read_only(arena, mapping):
    blocks = [arena.extents((3,), 1, PB), arena.extents((7, 2), 2, 2 * PB - 5)]
    data = [os.urandom(PB), os.urandom(2 * PB - 5)]
    for ext, d in zip(blocks, data):
        arena.write(ext, d)
    exts = [list(ext) for ext in blocks]
    got = mapping.gather_readonly(exts)
    assert [b"".join(vs) for vs in got] == data
    assert [[v.nbytes for v in vs] for vs in got] == [[n for _, n in e] for e in exts]
    assert [[bytes(v) for v in vs] for vs in got] == \
        [[bytes(v) for v in mapping.gather(e)] for e in exts]
    assert all(v.readonly for vs in got for v in vs)
    with pytest.raises(TypeError):
        got[0][0][0] = 1


@pytest.mark.parametrize("bad", [(0, PB), (HEADER_BYTES + PAGES * PB - 10, 11),
                                 (HEADER_BYTES, -1)])
def test_an_extent_outside_the_data_region_is_refused(mapping, bad):
    with pytest.raises(ValueError, match="outside the data region"):
        mapping.gather_readonly([[(HEADER_BYTES, PB)], [bad]])


def test_a_closed_mapping_refuses(mapping):
    mapping.close()
    with pytest.raises(ValueError, match="closed"):
        mapping.gather_readonly([[(HEADER_BYTES, PB)]])
