"""The cluster tier on a real Redis Cluster (three masters, one replica each):
two daemons share chains whose blocks spread over the masters, and a master
killed mid-traffic costs misses and dropped writes, never a client error;
hits resume once its replica has taken over."""
from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

import numpy as np

from kvkeeper.client import AsyncClient
from kvkeeper.server.ids import CLUSTER
from kvkeeper.server.tiers.cluster.format import redis_key
from kvkeeper.v1 import kvkeeper_pb2 as pb
from redis_servers import RedisCluster

BLOCK = 4 * 4096
CHAIN = 8


def ns() -> dict:
    return dict(model_id="tiny", dtype="float16", kv_layout="NHD", block_tokens=32,
                block_bytes=BLOCK)


def chain(salt: int) -> tuple[list[bytes], list[bytes]]:
    rng = np.random.default_rng(salt)
    ks = [(salt * 1000 + i).to_bytes(4, "little") * 8 for i in range(CHAIN)]
    return ks, [rng.integers(0, 256, BLOCK, dtype=np.uint8).tobytes() for _ in ks]


def cfg(cluster: RedisCluster, prefix: str, timeout_s: float = 5.0) -> dict:
    return {"cluster_tier.url": cluster.url, "cluster_tier.key_prefix": prefix,
            "cluster_tier.timeout_seconds": timeout_s}


async def connect(d: Any) -> AsyncClient:
    return await AsyncClient.connect(f"unix://{d.socket_path}", ns())


async def test_two_daemons_share_a_chain_over_the_masters(daemon_factory, redis_cluster):
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    a = await daemon_factory(**cfg(redis_cluster, prefix))
    b = await daemon_factory(**cfg(redis_cluster, prefix))
    ca, cb = await connect(a), await connect(b)
    ks, bs = chain(1)
    assert (await ca.save(ks, bs)).committed == CHAIN
    # The chain's blocks live on more than one master (per-key slots).
    (namespace,) = a.ledger.namespaces.values()
    owners = {redis_cluster.master_of(redis_key(prefix.encode(), namespace.id, k)).port
              for k in ks}
    assert len(owners) > 1
    m = await cb.match(ks, lease=True)
    assert m.matched == CHAIN and all(t == pb.TIER_CLUSTER for t in m.tiers)
    assert await cb.load(m.lease_id) == bs
    await cb.release(m.lease_id)
    assert b.cluster.probes == 1          # one pipelined call for the whole chain
    assert len(b.ledger.lower[CLUSTER]) == 0
    await b.cluster.refresh_memory()      # summed over the three masters
    assert b.cluster.used_memory > 3 * BLOCK * CHAIN // 8 and b.cluster.maxmemory == 0
    await ca.close()
    await cb.close()


async def test_a_master_killed_mid_traffic(daemon_factory, redis_cluster):
    prefix = f"t{uuid.uuid4().hex[:8]}:"
    # A short deadline: the calls to the dead master give up soon, the traffic goes on.
    a = await daemon_factory(**cfg(redis_cluster, prefix, timeout_s=0.5))
    b = await daemon_factory(**cfg(redis_cluster, prefix, timeout_s=0.5))
    ca, cb = await connect(a), await connect(b)
    errors: list[BaseException] = []
    wrong: list[int] = []
    rounds = 0
    stop = asyncio.Event()

    async def traffic() -> None:
        nonlocal rounds
        salt = 100
        while not stop.is_set():
            salt += 1
            ks, bs = chain(salt)
            try:
                await ca.save(ks, bs)
                m = await cb.match(ks, lease=True)
                if m.matched:
                    if await cb.load(m.lease_id) != bs[:m.matched]:
                        wrong.append(salt)
                    await cb.release(m.lease_id)
            except Exception as e:  # noqa: BLE001 - what the test counts
                errors.append(e)
            rounds += 1
            await asyncio.sleep(0.01)

    task = asyncio.get_running_loop().create_task(traffic())
    try:
        while rounds < 5:
            await asyncio.sleep(0.05)
        (namespace,) = a.ledger.namespaces.values()
        victim = redis_cluster.master_of(redis_key(prefix.encode(), namespace.id, chain(1)[0][0]))
        victim.kill()
        before = rounds
        await asyncio.to_thread(redis_cluster.wait_state_ok)
        while rounds < before + 10:
            await asyncio.sleep(0.05)
    finally:
        stop.set()
        await task
    assert errors == [] and wrong == []
    # Hits resume: a chain saved now is found whole through the other daemon.
    deadline = time.monotonic() + 30
    salt = 10_000
    while True:
        salt += 1
        ks, bs = chain(salt)
        await ca.save(ks, bs)
        m = await cb.match(ks, lease=True)
        if m.matched == CHAIN:
            assert await cb.load(m.lease_id) == bs
            await cb.release(m.lease_id)
            break
        if m.matched:
            await cb.release(m.lease_id)
        assert time.monotonic() < deadline, "hits did not resume after the failover"
        await asyncio.sleep(0.2)
    faults = sum(a.cluster.client.faults.values()) + sum(b.cluster.client.faults.values())
    print(f"rounds={rounds} faults={faults} dropped={a.cluster.flush_failures} "
          f"reconnects={a.cluster.client.reconnects}+{b.cluster.client.reconnects}")
    await ca.close()
    await cb.close()
    # Leave the cluster whole for the next test: the old master rejoins as a replica.
    victim.start()
    await asyncio.to_thread(redis_cluster.wait_ok)
