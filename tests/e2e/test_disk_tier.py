"""The disk tier behind a real daemon: durability, movement between tiers,
corruption, a full disk, two daemons on one directory, no blocked event loop."""
from __future__ import annotations

import asyncio
import os
import tempfile
import threading
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

from kvkeeper.client import AsyncClient, ResourceExhaustedError
from kvkeeper.server.tiers import disk as disk_mod
from kvkeeper.v1 import kvkeeper_pb2 as pb

BLOCK = 4 * 4096


def ns() -> dict:
    return dict(model_id="tiny", dtype="float16", kv_layout="NHD", block_tokens=32, block_bytes=BLOCK)


def keys(n: int, salt: int = 0) -> list[bytes]:
    return [(salt * 100000 + i).to_bytes(4, "little") * 8 for i in range(n)]


def blocks(n: int, seed: int = 0) -> list[bytes]:
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in range(n)]


@pytest.fixture
def disk_dir() -> Any:
    d = tempfile.mkdtemp(prefix="kvk-disk-", dir="/tmp")
    yield d
    import shutil
    shutil.rmtree(d, ignore_errors=True)


def disk_cfg(path: str, **kw: Any) -> dict:
    base = {"disk_tier.path": path, "disk_tier.capacity_bytes": 64 << 20}
    base.update({f"disk_tier.{k}": v for k, v in kw.items()})
    return base


async def connect(d: Any, **kw: Any) -> AsyncClient:
    return await AsyncClient.connect(f"unix://{d.socket_path}", ns(), **kw)


async def test_write_through_survives_restart(daemon_factory: Any, disk_dir: str) -> None:
    a = await daemon_factory(**disk_cfg(disk_dir))
    c = await connect(a)
    ks, bs = keys(5), blocks(5)
    assert (await c.save(ks, bs)).committed == 5
    # Acknowledged: every block is already a file.
    files = list(Path(disk_dir, "blocks").rglob("*.kvb"))
    assert len(files) == 5
    await c.close()
    await a.stop(0)

    b = await daemon_factory(**disk_cfg(disk_dir))
    assert b.disk.recovery.blocks == 5
    c = await connect(b)
    m = await c.match(ks, lease=True)
    assert m.matched == 5 and all(t == pb.TIER_DISK for t in m.tiers)
    assert await c.load(m.lease_id) == bs
    await c.release(m.lease_id)
    # Promoted: the next match is served from the arena.
    assert all(t == pb.TIER_HOST for t in (await c.match(ks)).tiers)
    text = b.metrics.render().decode()
    assert 'kvkeeper_hit_blocks_total{tier="disk"} 5.0' in text
    assert "kvkeeper_disk_recovered_blocks 5.0" in text
    b.ledger.check_invariants()
    b.disk.index.check_invariants()
    await c.close()


async def test_arena_eviction_keeps_blocks_on_disk(daemon_factory: Any, disk_dir: str) -> None:
    # 64 pages of arena = 16 blocks; save 40.
    d = await daemon_factory(**disk_cfg(disk_dir))
    c = await connect(d)
    ks, bs = keys(40), blocks(40, seed=3)
    for i in range(0, 40, 8):
        await c.save(ks[i:i + 8], bs[i:i + 8])
    assert d.ledger.top.blocks <= 16
    m = await c.match(ks[:10], lease=True)
    assert m.matched == 10
    assert pb.TIER_DISK in m.tiers
    assert await c.load(m.lease_id) == bs[:10]
    await c.release(m.lease_id)
    d.ledger.check_invariants()
    d.disk.index.check_invariants()
    await c.close()


async def test_write_back_is_flushed_on_shutdown(daemon_factory: Any, disk_dir: str) -> None:
    a = await daemon_factory(**disk_cfg(disk_dir, write_policy="write-back"))
    gate = threading.Event()
    real_write = a.disk.store.write

    def slow_write(*args: Any) -> int:
        gate.wait(10)
        return real_write(*args)

    a.disk.store.write = slow_write  # type: ignore[method-assign]
    c = await connect(a)
    ks, bs = keys(6, salt=1), blocks(6, seed=1)
    await c.save(ks, bs)  # acknowledged while the flush is held back
    assert not list(Path(disk_dir, "blocks").rglob("*.kvb"))
    await c.close()
    stopping = asyncio.ensure_future(a.stop(0))
    await asyncio.sleep(0.2)
    gate.set()
    await stopping
    assert len(list(Path(disk_dir, "blocks").rglob("*.kvb"))) == 6
    b = await daemon_factory(**disk_cfg(disk_dir))
    c = await connect(b)
    m = await c.match(ks, lease=True)
    assert m.matched == 6
    assert await c.load(m.lease_id) == bs
    await c.close()


async def test_promoted_blocks_carry_their_writers_checksum(daemon_factory: Any,
                                                           disk_dir: str) -> None:
    """A block back from disk is verified by its reader with the checksum its
    writer committed (kept in the file): XXH3-64, or CRC32 from an old-config
    client."""
    import xxhash
    import zlib

    a = await daemon_factory(**disk_cfg(disk_dir))
    new, old = await connect(a), await connect(a, checksum="crc32")
    ks, bs = keys(4, salt=7), blocks(4, seed=7)
    await new.save(ks[:2], bs[:2])
    await old.save(ks[2:], bs[2:])
    await new.close()
    await old.close()
    await a.stop(0)

    b = await daemon_factory(**disk_cfg(disk_dir))
    c = await connect(b, transport="shm")
    m = await c.match(ks, lease=True, blocks=True)
    assert m.matched == 4 and m.tiers == [pb.TIER_DISK] * 4
    assert [(r.checksum_algo, r.checksum) for r in m.blocks] == \
        [(pb.CHECKSUM_XXH3_64, xxhash.xxh3_64_intdigest(x)) for x in bs[:2]] + \
        [(pb.CHECKSUM_CRC32, zlib.crc32(x)) for x in bs[2:]]
    assert await c.load(m.lease_id) == bs   # verified with those
    await c.release(m.lease_id)
    await c.close()


async def test_corrupt_byte_on_disk_is_a_miss(daemon_factory: Any, disk_dir: str) -> None:
    a = await daemon_factory(**disk_cfg(disk_dir))
    c = await connect(a)
    ks, bs = keys(3, salt=2), blocks(3, seed=2)
    await c.save(ks, bs)
    await c.close()
    await a.stop(0)
    path = a.disk.store.block_path(a.ledger.namespaces[next(iter(a.ledger.namespaces))].id, ks[1])
    with open(path, "r+b") as f:
        f.seek(-7, os.SEEK_END)
        byte = f.read(1)
        f.seek(-7, os.SEEK_END)
        f.write(bytes([byte[0] ^ 0x55]))
    b = await daemon_factory(**disk_cfg(disk_dir))
    c = await connect(b)
    m = await c.match(ks, lease=True)
    assert m.matched == 1  # the chain stops at the corrupt block
    assert await c.load(m.lease_id) == bs[:1]
    await c.release(m.lease_id)
    assert b.disk.store.checksum_failures == 1
    assert list(Path(disk_dir, "quarantine").iterdir())
    assert "kvkeeper_disk_checksum_failures_total 1.0" in b.metrics.render().decode()
    await c.close()


async def test_full_disk_fails_write_through_and_reads_go_on(daemon_factory: Any, disk_dir: str) -> None:
    d = await daemon_factory(**disk_cfg(disk_dir))
    c = await connect(d)
    await c.save(keys(2), blocks(2))

    def full(*args: Any) -> int:
        raise d.disk.store._io_error(OSError(28, "No space left on device"), "writing")

    d.disk.store.write = full  # type: ignore[method-assign]
    with pytest.raises(ResourceExhaustedError) as info:
        await c.save(keys(2, salt=5), blocks(2, seed=5))
    assert "full" in info.value.details
    m = await c.match(keys(2), lease=True)
    assert m.matched == 2 and await c.load(m.lease_id) == blocks(2)
    await c.release(m.lease_id)
    d.ledger.check_invariants()
    d.disk.index.check_invariants()
    await c.close()


async def test_two_daemons_share_one_directory(daemon_factory: Any, disk_dir: str) -> None:
    a = await daemon_factory(**disk_cfg(disk_dir, owner_id="a"))
    b = await daemon_factory(**disk_cfg(disk_dir, owner_id="b"))
    ca, cb = await connect(a), await connect(b)
    ks, bs = keys(4, salt=7), blocks(4, seed=7)
    await ca.save(ks, bs)
    # B never saw these blocks: its index misses, the files answer.
    m = await cb.match(ks, lease=True)
    assert m.matched == 4 and all(t == pb.TIER_DISK for t in m.tiers)
    assert await cb.load(m.lease_id) == bs
    await cb.release(m.lease_id)
    await ca.close()
    await cb.close()


async def test_disk_io_does_not_block_the_event_loop(daemon_factory: Any, disk_dir: str) -> None:
    d = await daemon_factory(**disk_cfg(disk_dir))
    gate = threading.Event()
    real_write = d.disk.store.write

    def stuck_write(*args: Any) -> int:
        gate.wait(10)
        return real_write(*args)

    d.disk.store.write = stuck_write  # type: ignore[method-assign]
    writer, reader = await connect(d), await connect(d)
    saving = asyncio.ensure_future(writer.save(keys(4, salt=9), blocks(4, seed=9)))
    await asyncio.sleep(0.2)
    assert not saving.done()
    # While a write is stuck in the disk, Match is still answered.
    m = await asyncio.wait_for(reader.match(keys(4, salt=9)), timeout=2)
    assert m.matched == 4
    gate.set()
    assert (await saving).committed == 4
    await writer.close()
    await reader.close()


async def test_only_the_gc_owner_deletes_and_never_a_pinned_file(daemon_factory: Any,
                                                                 disk_dir: str) -> None:
    # lru admits every block: this test is about who deletes, not about s3fifo's
    # disk admission (which would refuse a full disk's never-hit newcomers).
    lru = {"ledger.eviction_policy": "lru"}
    a = await daemon_factory(**disk_cfg(disk_dir, owner_id="a", capacity_bytes=6 * (BLOCK + 128)),
                             **lru)
    b = await daemon_factory(**disk_cfg(disk_dir, owner_id="b", capacity_bytes=6 * (BLOCK + 128)),
                             **lru)
    assert a.disk.gc_owner and not b.disk.gc_owner
    cb = await connect(b)
    # B fills and overflows its share: it forgets entries but deletes no file.
    for i in range(3):
        await cb.save(keys(4, salt=20 + i), blocks(4, seed=20 + i))
    assert sum(b.disk.index.evictions.values()) > 0
    assert len(list(Path(disk_dir, "blocks").rglob("*.kvb"))) == 12
    # A evicts too, but a file that B pins stays.
    victim_ns = next(iter(b.ledger.namespaces))
    b.disk.store.pin(victim_ns, keys(4, salt=20)[0], "b", 60)
    ca = await connect(a)
    for i in range(3):
        await ca.save(keys(4, salt=30 + i), blocks(4, seed=30 + i))
    assert sum(a.disk.index.evictions.values()) > 0
    assert os.path.exists(a.disk.store.block_path(victim_ns, keys(4, salt=20)[0]))
    await ca.close()
    await cb.close()


def test_kill_9_during_a_storm_of_saves_loses_nothing_acknowledged(tmp_path: Path,
                                                                   disk_dir: str) -> None:
    import random
    import signal
    import subprocess
    import sys
    import time

    from kvkeeper.client import Client

    sock = tmp_path / "k.sock"
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvkeeper.server.cli", "serve", "--socket", str(sock), "--tcp", "",
         "--metrics", "", "--capacity", "8MiB", "--page-size", "16KiB", "--disk-path", disk_dir,
         "--disk-capacity", "256MiB"], stderr=subprocess.DEVNULL)
    acked: dict[bytes, bytes] = {}
    try:
        deadline = time.monotonic() + 20
        while not sock.exists():
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.05)
        # The socket exists from bind on; under load the first answer can take
        # seconds, so register with a generous deadline (the kill is what's tested).
        c = Client.connect(f"unix://{sock}", ns(), max_retries=0, timeout=15)
        rng = random.Random(1)
        kill_at = time.monotonic() + 1.5
        i = 0
        try:
            while True:
                ks = keys(4, salt=1000 + i)
                bs = [rng.randbytes(BLOCK) for _ in range(4)]
                if time.monotonic() > kill_at:
                    os.kill(proc.pid, signal.SIGKILL)
                c.save(ks, bs)
                acked.update(zip(ks, bs))
                i += 1
        except Exception:  # noqa: BLE001 - the daemon died under us, as intended
            pass
        c.close()
    finally:
        proc.kill()
        proc.wait()
    assert len(acked) >= 8

    async def check() -> None:
        import uuid

        from kvkeeper.server.app import create_server
        cfg_dir = tempfile.mkdtemp(prefix="kvk-", dir="/tmp")
        from kvkeeper.server.config import load_config
        cfg = load_config(None, env={}, overrides={
            "listen.socket": os.path.join(cfg_dir, "k.sock"), "listen.tcp": "", "metrics.address": "",
            "host_tier.capacity_bytes": 64 << 20, "host_tier.page_bytes": 16384,
            "host_tier.name": f"kvkeeper-test-{uuid.uuid4().hex[:12]}",
            "disk_tier.path": disk_dir, "disk_tier.capacity_bytes": 256 << 20})
        d, _ = create_server(cfg)
        await d.start()
        try:
            assert d.disk.recovery.blocks >= len(acked)
            c = await connect(d)
            ks = list(acked)
            for j in range(0, len(ks), 64):
                part = ks[j:j + 64]
                m = await c.match(part[:1], lease=True)
                assert m.matched == 1, "an acknowledged block is missing after kill -9"
                await c.release(m.lease_id)
                got = []
                for k in part:
                    m = await c.match([k], lease=True)
                    assert m.matched == 1
                    got.append((await c.load(m.lease_id))[0])
                    await c.release(m.lease_id)
                assert got == [acked[k] for k in part]
            await c.close()
        finally:
            await d.stop(0)

    asyncio.run(check())


async def test_a_really_full_filesystem(daemon_factory: Any) -> None:
    """ENOSPC from the kernel, on a 256 KiB tmpfs (needs root, as CI runs)."""
    import subprocess
    mnt = tempfile.mkdtemp(prefix="kvk-full-", dir="/tmp")
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=256k", "tmpfs", mnt],
                      capture_output=True).returncode != 0:
        os.rmdir(mnt)
        pytest.skip("cannot mount a tmpfs here (not root)")
    try:
        d = await daemon_factory(**disk_cfg(os.path.join(mnt, "tier"), capacity_bytes=64 << 20))
        c = await connect(d)
        saved: list[tuple[bytes, bytes]] = []
        with pytest.raises(ResourceExhaustedError) as info:
            for i in range(64):
                k, b = keys(1, salt=300 + i), blocks(1, seed=300 + i)
                await c.save(k, b)
                saved.append((k[0], b[0]))
        assert "full" in info.value.details
        assert saved, "the filesystem should take a few blocks before it fills"
        assert d.disk.store.io_errors >= 1
        # Reads go on: what was acknowledged still loads.
        k0, b0 = saved[0]
        m = await c.match([k0], lease=True)
        assert m.matched == 1 and (await c.load(m.lease_id)) == [b0]
        await c.release(m.lease_id)
        d.disk.index.check_invariants()
        d.ledger.check_invariants()
        await c.close()
        await d.stop(0)
    finally:
        subprocess.run(["umount", mnt], capture_output=True)
        os.rmdir(mnt)


async def test_match_with_blocks_promotes_disk_hits_into_the_arena(daemon_factory: Any,
                                                                   disk_dir: str) -> None:
    a = await daemon_factory(**disk_cfg(disk_dir))
    c = await connect(a)
    ks, bs = keys(4, salt=5), blocks(4, seed=5)
    await c.save(ks, bs)
    await c.close()
    await a.stop(0)

    b = await daemon_factory(**disk_cfg(disk_dir))
    assert b.ledger.top.blocks == 0  # only on disk
    c = await connect(b, transport="shm")
    await c.save(ks[:1], bs[:1])  # the head in the arena, the rest on disk
    m = await c.match(ks, lease=True, blocks=True)
    assert m.matched == 4 and m.tiers == [pb.TIER_HOST] + [pb.TIER_DISK] * 3
    assert [r.key for r in m.blocks] == ks
    # The refs point into the arena: the promoted copies, pinned by the lease.
    views = c.arena_views(m.blocks)
    assert views is not None and [b"".join(vs) for vs in views] == bs
    assert all(blk.tier is b.ledger.top for blk in b.ledger.leases[m.lease_id].blocks)
    outs = [bytearray(BLOCK) for _ in range(4)]
    await c.load_into(m.lease_id, outs)  # verifies the checksums given at the first save
    assert [bytes(o) for o in outs] == bs
    await c.release(m.lease_id)
    b.ledger.check_invariants()
    b.disk.index.check_invariants()
    await c.close()
