"""ClusterTier against a real redis-server: moving blocks, the chain probe,
and every fault a miss or a dropped write, counted, never an exception
other than the TierErrors the stack turns into misses."""
from __future__ import annotations

import asyncio
import os
import signal
from typing import Any, Optional

import numpy as np
import pytest

from kvkeeper.server.tiers.backend import NotStored, TierError
from kvkeeper.server.tiers.cluster.client import ClusterClient, ClusterFault
from kvkeeper.server.tiers.cluster.config import ClusterSettings, parse_cluster_url
from kvkeeper.server.tiers.cluster.format import HEADER_BYTES, CorruptValue, redis_key
from kvkeeper.server.tiers.cluster.tier import ClusterTier
from redis_servers import RedisServer

NS = bytes(range(16))
KiB = 1 << 10


class Buffers:
    """A BlockStore of plain memory: one bytearray per location."""

    def __init__(self, one_piece: bool = True) -> None:
        self.one_piece = one_piece
        self.data: dict[Any, bytearray] = {}

    def view(self, loc: Any) -> Optional[memoryview]:
        if not self.one_piece:
            return None
        return memoryview(self.data.setdefault(loc[0], bytearray(loc[1])))

    def read_into(self, loc: Any, out: Any) -> None:
        memoryview(out)[:] = self.data[loc[0]]

    def write(self, loc: Any, data: Any, checksum: Any = None) -> int:
        self.data[loc[0]] = bytearray(data)
        return len(self.data[loc[0]])


def key(i: int) -> bytes:
    return i.to_bytes(32, "big")


def rand(n: int, seed: int) -> bytes:
    return np.random.default_rng(seed).integers(0, 256, n, dtype=np.uint8).tobytes()


def make_tier(url: str, **kw: Any) -> ClusterTier:
    """A tier on `url`; a deadline generous for a busy CI host unless the test sets one."""
    kw.setdefault("timeout_s", 5.0)
    s = ClusterSettings(parse_cluster_url(url), key_prefix=f"t{os.getpid()}:", **kw)
    return ClusterTier(s, ClusterClient(s, None))


async def lead(tier: ClusterTier, keys: list[bytes], ns: bytes = NS) -> list[int]:
    """The leading run of a probe (what the stack counts)."""
    out = []
    for n in await tier.probe_run(ns, keys):
        if n is None:
            break
        out.append(n)
    return out


async def save(tier: ClusterTier, i: int, n: int, seed: int = 0) -> bytes:
    data = rand(n, seed * 1000 + i)
    src = Buffers()
    src.data[("s", i)] = bytearray(data)
    await tier.write_block(src, (("s", i), n), tier.loc(NS, key(i), n))
    return data


async def load(tier: ClusterTier, i: int, n: int, one_piece: bool = True) -> bytes:
    dst = Buffers(one_piece)
    await tier.read_block(tier.loc(NS, key(i), n), dst, (("d", i), n))
    return bytes(dst.data[("d", i)])


@pytest.fixture
async def tier(redis_server: RedisServer) -> Any:
    redis_server.cli("FLUSHALL")
    t = make_tier(f"redis://{redis_server.address}")
    yield t
    await t.close()


@pytest.mark.parametrize("n", [1, 4095, 64 * KiB, 256 * KiB + 5, 4 << 20])
async def test_round_trip(tier, n):
    data = await save(tier, 1, n)
    assert await load(tier, 1, n) == data
    assert await load(tier, 1, n, one_piece=False) == data   # through write(), not a view
    assert tier.hits == 2 and tier.written_blocks == 1
    assert tier.written_bytes == n + HEADER_BYTES and tier.read_bytes == 2 * (n + HEADER_BYTES)


async def test_overwrite_replaces(tier):
    await save(tier, 2, 1000, seed=1)
    data = await save(tier, 2, 1000, seed=2)
    assert await load(tier, 2, 1000) == data


async def test_probe_counts_only_the_leading_run(tier, redis_server):
    for i in (0, 1, 2, 4):
        await save(tier, i, 5000)
    keys = [key(i) for i in range(6)]
    assert await tier.probe_run(NS, keys) == [5000, 5000, 5000, None, 5000, None]
    assert await lead(tier, keys) == [5000, 5000, 5000]
    assert await lead(tier, keys[3:]) == []
    assert await lead(tier, keys[4:]) == [5000]
    assert tier.probes == 4 and tier.misses == 4
    # Another namespace's keys are other Redis keys.
    assert await lead(tier, keys, bytes(16)) == []


async def test_a_probe_asks_at_most_max_keys_per_call(redis_server):
    redis_server.cli("FLUSHALL")
    t = make_tier(f"redis://{redis_server.address}", max_keys_per_call=2)
    try:
        for i in range(4):
            await save(t, i, 100)
        assert await t.probe_run(NS, [key(i) for i in range(4)]) == [100, 100]
        assert t.probed_keys == 2 and t.misses == 0
    finally:
        await t.close()


async def test_a_vanished_block_is_not_stored(tier, redis_server):
    await save(tier, 3, 100)
    redis_server.cli("DEL", redis_key(tier.prefix, NS, key(3)).decode())
    with pytest.raises(NotStored):
        await load(tier, 3, 100)
    assert tier.vanished == 1 and tier.misses == 1 and tier.hits == 0


@pytest.mark.parametrize("at", [0, 20, HEADER_BYTES + 7])
async def test_a_corrupt_value_is_deleted_counted_and_never_served(tier, redis_server, at):
    await save(tier, 4, 300)
    rk = redis_key(tier.prefix, NS, key(4)).decode()
    redis_server.cli("SETRANGE", rk, str(at), "\x7f")
    with pytest.raises(CorruptValue):
        await load(tier, 4, 300)
    assert redis_server.cli("EXISTS", rk) == "0"
    assert tier.corrupt == 1 and tier.hits == 0 and tier.errors()["corrupt_values"] == 1


async def test_a_value_of_another_block_size_is_corrupt(tier):
    await save(tier, 5, 300)
    with pytest.raises(CorruptValue):
        await load(tier, 5, 301)


async def answers_again(t: ClusterTier, keys: list[bytes]) -> list:
    """Probe until the cluster answers (the tier tries once a second while it is down)."""
    for _ in range(100):
        got = await t.probe_run(NS, keys)
        if got:
            return got
        await asyncio.sleep(0.1)
    raise AssertionError("the cluster tier did not reach the server again")


async def test_a_stopped_server_costs_misses_and_the_tier_reconnects(own_server):
    t = make_tier(f"redis://{own_server.address}")
    try:
        data = await save(t, 1, 1000)
        own_server.stop()
        assert await t.probe_run(NS, [key(1)]) == []
        assert t.client.faults["connection"] == 1 and not t.client.up
        # Down: the next calls are not sent (one a second tries); misses at once.
        with pytest.raises(ClusterFault) as e:
            await load(t, 1, 1000)
        assert e.value.kind == "unreachable"
        with pytest.raises(ClusterFault):
            await save(t, 2, 1000)
        assert t.client.skipped == 2 and t.errors()["faults"] == 1
        own_server.start()   # the same port, empty
        assert await answers_again(t, [key(1)]) == [None]
        assert t.client.up and t.client.reconnects == 1
        data = await save(t, 1, 1000)
        assert await load(t, 1, 1000) == data
    finally:
        await t.close()


async def test_a_paused_server_times_out_within_the_deadline(own_server):
    t = make_tier(f"redis://{own_server.address}", timeout_s=1.0)
    try:
        await save(t, 1, 1000)
        assert own_server.proc is not None
        os.kill(own_server.proc.pid, signal.SIGSTOP)
        # Liveness, not speed: each call gives up by itself (the outer bound is far off).
        assert await asyncio.wait_for(t.probe_run(NS, [key(1)]), 20) == []
        await asyncio.sleep(1.0)   # past RETRY_S: the next call is sent, and times out too
        with pytest.raises(ClusterFault) as e:
            await asyncio.wait_for(load(t, 1, 1000), 20)
        assert e.value.kind == "timeout" and t.client.faults["timeout"] == 2
        os.kill(own_server.proc.pid, signal.SIGCONT)
        assert await answers_again(t, [key(1)]) == [1000]
        assert t.client.reconnects == 1
        counters = {c.name: c.value for c in t.counters() if not c.labels}
        assert counters["cluster_timeouts"] == 2 and counters["cluster_up"] == 1
    finally:
        await t.close()


async def test_the_background_upkeep_reconnects_without_traffic(own_server):
    t = make_tier(f"redis://{own_server.address}")
    try:
        own_server.stop()
        assert await t.probe_run(NS, [key(1)]) == [] and not t.client.up
        own_server.start()
        for _ in range(100):   # the reaper's ticks
            await t.maintain()
            await asyncio.sleep(0.1)
            if t.client.up:
                break
        assert t.client.up and t.client.reconnects == 1
    finally:
        await t.close()


async def test_oom_and_readonly_drop_writes(own_server):
    t = make_tier(f"redis://{own_server.address}")
    try:
        own_server.limit_memory(1, "noeviction")
        with pytest.raises(ClusterFault) as e:
            await save(t, 1, 1000)
        assert e.value.kind == "oom" and isinstance(e.value, TierError)
        own_server.limit_memory(0, "noeviction")
        data = await save(t, 1, 1000)
        # A replica (of a master that is not there) refuses writes and still serves reads.
        own_server.cli("REPLICAOF", "127.0.0.1", "1")
        with pytest.raises(ClusterFault) as e:
            await save(t, 2, 1000)
        assert e.value.kind == "readonly"
        own_server.cli("REPLICAOF", "NO", "ONE")
        assert await load(t, 1, 1000) == data
        assert t.client.faults["oom"] == 1 and t.client.faults["readonly"] == 1
        labelled = {c.labels: c.value for c in t.counters() if c.labels}
        assert labelled[(("kind", "oom"),)] == 1 and labelled[(("kind", "readonly"),)] == 1
    finally:
        await t.close()


async def test_maxmemory_eviction_is_misses_not_errors(own_server):
    t = make_tier(f"redis://{own_server.address}")
    try:
        own_server.limit_memory(4 << 20, "allkeys-lru")
        n = 64 * KiB
        for i in range(200):   # 12.5 MiB into 4 MiB
            await save(t, i, n)
        assert len(await lead(t, [key(i) for i in range(200)])) < 200
        late = [i for i in range(200) if await lead(t, [key(i)])]
        assert 0 < len(late) < 200
        assert await load(t, late[-1], n) == rand(n, late[-1])
        assert sum(t.client.faults.values()) == 0
        await t.refresh_memory()
        assert 0 < t.used_memory and t.maxmemory == 4 << 20
    finally:
        await t.close()


async def test_more_calls_at_once_than_connections_wait_their_turn(redis_server):
    redis_server.cli("FLUSHALL")
    t = make_tier(f"redis://{redis_server.address}", max_connections=2)
    try:
        datas = await asyncio.gather(*(save(t, i, 10000) for i in range(16)))
        got = await asyncio.gather(*(load(t, i, 10000) for i in range(16)))
        assert got == datas and sum(t.client.faults.values()) == 0
    finally:
        await t.close()
