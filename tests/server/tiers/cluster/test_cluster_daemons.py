"""The cluster tier behind real daemons and a real redis-server: two daemons
with separate arenas (as on two hosts) share blocks through it; a corrupt
value, eviction and an unreachable cluster are misses, never client errors;
a wrong password stops start-up naming the key (TLS: test_cluster_tls.py)."""
from __future__ import annotations

import os
import subprocess
import sys

from cluster_daemon_helpers import blocks, cluster_cfg, connect, keys, ns_id, start_fails
from kvkeeper.server.ids import CLUSTER
from kvkeeper.server.tiers.cluster.format import redis_key
from kvkeeper.v1 import kvkeeper_pb2 as pb
from redis_servers import RedisServer, free_port, needs_redis, one_node_cluster, remove, temp_root



async def test_two_daemons_share_blocks_through_the_cluster(daemon_factory, redis_server, prefix):
    a = await daemon_factory(**cluster_cfg(f"redis://{redis_server.address}", prefix))
    b = await daemon_factory(**cluster_cfg(f"redis://{redis_server.address}", prefix))
    ca, cb = await connect(a), await connect(b)
    ks, bs = keys(6), blocks(6)
    assert (await ca.save(ks[:4], bs[:4])).committed == 4   # write-through: in the cluster now
    look = await cb.match(ks)                                # no lease: a lookup
    assert look.matched == 4 and all(t == pb.TIER_CLUSTER for t in look.tiers)
    m = await cb.match(ks, lease=True)
    assert m.matched == 4 and all(t == pb.TIER_CLUSTER for t in m.tiers)
    assert await cb.load(m.lease_id) == bs[:4]
    await cb.release(m.lease_id)
    # Promoted into b's arena: served from there now.
    assert all(t == pb.TIER_HOST for t in (await cb.match(ks, lease=False)).tiers)
    # No mirror of the cluster in either daemon: the books hold nothing at rest.
    assert len(a.ledger.lower[CLUSTER]) == 0 and len(b.ledger.lower[CLUSTER]) == 0
    assert b.cluster.hits == 4 and a.cluster.written_blocks == 4
    text = b.metrics.render().decode()
    assert "kvkeeper_cluster_hit_blocks_total 4.0" in text
    # Two Matches found the 4 blocks in the cluster (the lookup and the leased one).
    assert 'kvkeeper_hit_blocks_total{tier="cluster"} 8.0' in text
    assert 'kvkeeper_cluster_errors_total{kind="timeout"} 0.0' in text
    a.ledger.check_invariants()
    b.ledger.check_invariants()
    await ca.close()
    await cb.close()


async def test_below_a_disk_tier(daemon_factory, redis_server, prefix, tmp_path):
    """Disk first, then the cluster: a host's own disk answers before the network."""
    def cfg(name: str) -> dict:
        return {**cluster_cfg(f"redis://{redis_server.address}", prefix),
                "disk_tier.path": str(tmp_path / name), "disk_tier.capacity_bytes": 16 << 20}

    a, b = await daemon_factory(**cfg("a")), await daemon_factory(**cfg("b"))
    ca, cb = await connect(a), await connect(b)
    ks, bs = keys(4, salt=9), blocks(4, seed=9)
    await ca.save(ks, bs)
    assert len(a.disk.index) == 4 and a.cluster.written_blocks == 4
    m = await cb.match(ks, lease=True)                    # b's disk has none: the cluster
    assert m.matched == 4 and set(m.tiers) == {pb.TIER_CLUSTER}
    assert await cb.load(m.lease_id) == bs
    await cb.release(m.lease_id)
    a.ledger.reclaim_unpinned()                            # a's arena forgets; its disk has them
    m = await ca.match(ks, lease=True)
    assert m.matched == 4 and set(m.tiers) == {pb.TIER_DISK}
    assert await ca.load(m.lease_id) == bs
    assert a.cluster.probes == 0
    a.ledger.check_invariants()
    b.ledger.check_invariants()
    await ca.close()
    await cb.close()


async def test_write_back_reaches_the_cluster_after_the_save(daemon_factory, redis_server,
                                                             prefix):
    a = await daemon_factory(**cluster_cfg(f"redis://{redis_server.address}", prefix,
                                           write_policy="write-back"))
    b = await daemon_factory(**cluster_cfg(f"redis://{redis_server.address}", prefix))
    ca, cb = await connect(a), await connect(b)
    ks, bs = keys(3, salt=1), blocks(3, seed=1)
    await ca.save(ks, bs)
    await a.stack.drain()
    m = await cb.match(ks, lease=True)
    assert m.matched == 3 and await cb.load(m.lease_id) == bs
    await ca.close()
    await cb.close()



async def test_admission_sends_a_block_once_it_is_hit(daemon_factory, redis_server, prefix):
    a = await daemon_factory(**cluster_cfg(f"redis://{redis_server.address}", prefix,
                                           admit_after_hits=1))
    ca = await connect(a)
    ks, bs = keys(2, salt=8), blocks(2, seed=8)
    await ca.save(ks, bs)
    await a.stack.drain()
    assert a.cluster.written_blocks == 0          # not hit yet: not sent
    for _ in range(3):
        m = await ca.match(ks, lease=True)
        await ca.release(m.lease_id)
        await a.stack.drain()
    # Sent once on its first hit; the hits after it do not send it again.
    assert a.cluster.written_blocks == 2
    assert redis_server.cli("EXISTS", redis_key(prefix.encode(), ns_id(a), ks[0]).decode()) == "1"
    await ca.close()


async def test_a_corrupt_value_is_a_miss_deleted_and_counted(daemon_factory, redis_server, prefix):
    a = await daemon_factory(**cluster_cfg(f"redis://{redis_server.address}", prefix))
    b = await daemon_factory(**cluster_cfg(f"redis://{redis_server.address}", prefix))
    ca, cb = await connect(a), await connect(b)
    ks, bs = keys(3, salt=2), blocks(3, seed=2)
    await ca.save(ks, bs)
    rk = redis_key(prefix.encode(), ns_id(a), ks[1]).decode()
    redis_server.cli("SETRANGE", rk, "500", "garbage")
    m = await cb.match(ks, lease=True)
    assert m.matched == 1                      # the chain ends at the corrupt block
    assert await cb.load(m.lease_id) == bs[:1]
    await cb.release(m.lease_id)
    assert redis_server.cli("EXISTS", rk) == "0"
    assert b.cluster.corrupt == 1 and b.cluster.errors()["corrupt_values"] == 1
    assert "kvkeeper_cluster_corrupt_values_total 1.0" in b.metrics.render().decode()
    b.ledger.check_invariants()
    await ca.close()
    await cb.close()


async def test_maxmemory_eviction_under_pressure_is_misses(daemon_factory, own_server, prefix):
    own_server.limit_memory(3 << 20, "allkeys-lru")
    a = await daemon_factory(**cluster_cfg(f"redis://{own_server.address}", prefix))
    b = await daemon_factory(**cluster_cfg(f"redis://{own_server.address}", prefix))
    ca, cb = await connect(a), await connect(b)
    ks, bs = keys(400, salt=3), blocks(400, seed=3)   # 6.25 MiB into 3 MiB
    for i in range(0, 400, 8):
        assert (await ca.save(ks[i:i + 8], bs[i:i + 8])).committed == 8
    hit = 0
    for i in range(0, 400, 8):
        m = await cb.match(ks[i:i + 8], lease=True)
        if m.matched:
            assert await cb.load(m.lease_id) == bs[i:i + m.matched]
            await cb.release(m.lease_id)
        hit += m.matched
    assert 0 < hit < 400
    assert sum(a.cluster.client.faults.values()) == 0 == sum(b.cluster.client.faults.values())
    assert a.cluster.flush_failures == 0
    await ca.close()
    await cb.close()


async def test_an_unreachable_cluster_at_start_up_is_misses(daemon_factory, prefix):
    d = await daemon_factory(**cluster_cfg(f"redis://127.0.0.1:{free_port()}", prefix,
                                           timeout_seconds=0.3))
    c = await connect(d)
    ks, bs = keys(2, salt=4), blocks(2, seed=4)
    assert (await c.save(ks, bs)).committed == 2       # dropped below, kept in the arena
    m = await c.match(ks + keys(2, salt=5), lease=True)
    assert m.matched == 2 and await c.load(m.lease_id) == bs
    await c.release(m.lease_id)
    assert d.cluster.flush_failures == 2 and not d.cluster.client.up
    assert "kvkeeper_cluster_up 0.0" in d.metrics.render().decode()
    await c.close()


# ---------------------------------------------------------------- start-up errors


@needs_redis
async def test_a_wrong_password_stops_start_up_naming_the_key(daemon_config, daemon_factory,
                                                              tmp_path, prefix):
    root = temp_root()
    srv = RedisServer(root, password="right")
    try:
        pw = tmp_path / "pw"
        pw.write_text("wrong\n")
        url = f"redis://{srv.address}"
        err = start_fails(daemon_config, **cluster_cfg(url, prefix, password_file=str(pw)))
        assert err.key == "cluster_tier.password_file" and "cluster_tier.password_file" in str(err)
        err = start_fails(daemon_config, **cluster_cfg(url, prefix))   # none at all
        assert err.key == "cluster_tier.password_file"
        pw.write_text("right\n")
        d = await daemon_factory(**cluster_cfg(url, prefix, password_file=str(pw)))
        assert d.cluster.client.up
        # An ACL user allowed only the tier's keys works; another user name does not.
        srv.cli("ACL", "SETUSER", "kv", "on", ">kvpw", f"~{prefix}*", "+@all")
        pw.write_text("kvpw\n")
        err = start_fails(daemon_config, **cluster_cfg(url, prefix, password_file=str(pw),
                                                       username="nobody"))
        assert err.key == "cluster_tier.password_file" and "nobody" in str(err)
        d = await daemon_factory(**cluster_cfg(url, prefix, password_file=str(pw), username="kv"))
        c = await connect(d)
        ks, bs = keys(2, salt=10), blocks(2, seed=10)
        await c.save(ks, bs)
        assert d.cluster.written_blocks == 2 and sum(d.cluster.client.faults.values()) == 0
        await c.close()
    finally:
        srv.stop()
        remove(root)


@needs_redis
async def test_a_cluster_asking_for_a_password_stops_start_up(daemon_config, tmp_path, prefix):
    root = temp_root()
    srv = one_node_cluster(root, password="right")
    try:
        url = f"redis+cluster://{srv.address}"
        err = start_fails(daemon_config, **cluster_cfg(url, prefix))         # none given
        assert err.key == "cluster_tier.password_file"
        pw = tmp_path / "pw"
        pw.write_text("wrong\n")
        err = start_fails(daemon_config, **cluster_cfg(url, prefix, password_file=str(pw)))
        assert err.key == "cluster_tier.password_file"
    finally:
        srv.stop()
        remove(root)


@needs_redis
def test_serve_exits_with_the_key_in_its_config_error(tmp_path, prefix):
    root = temp_root()
    srv = RedisServer(root, password="right")
    try:
        pw = tmp_path / "pw"
        pw.write_text("Pw-7f3a-not-it\n")
        r = subprocess.run(
            [sys.executable, "-m", "kvkeeper.server.cli", "serve", "--socket",
             str(tmp_path / "k.sock"), "--tcp", "", "--metrics", "", "--capacity", "1MiB",
             "--cluster-url", f"redis://{srv.address}",
             "--set", f"cluster_tier.password_file={pw}"],
            capture_output=True, text=True, timeout=60, env={**os.environ, "KVKEEPER_CONFIG": ""})
        assert r.returncode == 2, r.stderr
        # The key is named; the password itself is in no log line.
        assert "cluster_tier.password_file" in r.stderr and "Pw-7f3a" not in r.stderr
    finally:
        srv.stop()
        remove(root)
