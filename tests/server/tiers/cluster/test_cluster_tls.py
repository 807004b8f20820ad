"""The cluster tier over TLS (rediss://, rediss+cluster://): blocks shared
through one TLS server and through a Redis Cluster whose clients, cluster bus
and replication all speak TLS; a TLS setting that does not fit the server
stops start-up naming the key."""
from __future__ import annotations

from pathlib import Path
from typing import Iterator

import pytest

from cluster_daemon_helpers import blocks, cluster_cfg, connect, keys, load_pki, start_fails
from kvkeeper.v1 import kvkeeper_pb2 as pb
from redis_servers import HAVE_REDIS, NO_REDIS, RedisCluster, RedisServer, remove, temp_root


@pytest.fixture(scope="module")
def pki_dirs() -> Iterator[tuple[Path, Path, Path]]:
    """(root, good, other): two throwaway CAs, each with a server certificate."""
    pki = load_pki()
    if not HAVE_REDIS:
        pytest.skip(NO_REDIS)
    if pki.openssl() is None:
        pytest.skip("openssl not installed")
    root = temp_root()
    good, other = root / "pki", root / "other"
    good.mkdir()
    other.mkdir()
    pki.make_pki(good)
    pki.make_pki(other)
    yield root, good, other
    remove(root)


@pytest.fixture(scope="module")
def tls_server(pki_dirs) -> Iterator[tuple[RedisServer, Path, Path]]:
    root, good, other = pki_dirs
    try:
        srv = RedisServer(root, tls_dir=good)
    except AssertionError as e:
        pytest.skip(f"this redis-server has no TLS: {e}")
    yield srv, good, other
    srv.stop()


@pytest.fixture(scope="module")
def tls_cluster(pki_dirs) -> Iterator[tuple[RedisCluster, Path]]:
    root, good, _ = pki_dirs
    try:
        cluster = RedisCluster(root / "cluster", tls_dir=good)
    except AssertionError as e:
        pytest.skip(f"this redis-server or redis-cli has no TLS cluster: {e}")
    yield cluster, good
    cluster.stop()


async def test_tls_to_a_plain_server_stops_start_up_naming_the_url(daemon_config, redis_server,
                                                                   prefix):
    err = start_fails(daemon_config, **cluster_cfg(f"rediss://{redis_server.address}", prefix,
                                                   timeout_seconds=0.5))
    assert err.key == "cluster_tier.url" and "without TLS" in str(err)


async def test_tls_misconfiguration_stops_start_up_naming_the_key(daemon_config, tls_server, prefix):
    srv, good, other = tls_server
    url = f"rediss://{srv.address}"
    err = start_fails(daemon_config, **cluster_cfg(url, prefix, ca_file=str(other / "ca.pem")))
    assert err.key == "cluster_tier.ca_file" and "cluster_tier.ca_file" in str(err)
    err = start_fails(daemon_config, **cluster_cfg(f"redis://{srv.address}", prefix))
    assert err.key == "cluster_tier.url"
    err = start_fails(daemon_config, **cluster_cfg(url, prefix, ca_file=str(good / "none.pem")))
    assert err.key == "cluster_tier.ca_file"


async def test_tls_round_trip(daemon_factory, tls_server, prefix):
    srv, good, _ = tls_server
    cfg = cluster_cfg(f"rediss://{srv.address}", prefix, ca_file=str(good / "ca.pem"))
    a, b = await daemon_factory(**cfg), await daemon_factory(**cfg)
    ca, cb = await connect(a), await connect(b)
    ks, bs = keys(2, salt=6), blocks(2, seed=6)
    await ca.save(ks, bs)
    m = await cb.match(ks, lease=True)
    assert m.matched == 2 and await cb.load(m.lease_id) == bs
    await ca.close()
    await cb.close()


async def test_two_daemons_share_a_chain_through_a_tls_cluster(daemon_factory, tls_cluster,
                                                                prefix):
    cluster, good = tls_cluster
    assert cluster.url.startswith("rediss+cluster://")
    cfg = cluster_cfg(cluster.url, prefix, ca_file=str(good / "ca.pem"))
    a, b = await daemon_factory(**cfg), await daemon_factory(**cfg)
    ca, cb = await connect(a), await connect(b)
    # Keys without a hash tag: the chain spreads over all three masters.
    ks, bs = keys(12, salt=11), blocks(12, seed=11)
    assert (await ca.save(ks, bs)).committed == 12
    held = [int(n.cli("DBSIZE")) for n in cluster.masters()]
    assert len(held) == 3 and all(held), f"every master holds some of the chain: {held}"
    m = await cb.match(ks, lease=True)
    assert m.matched == 12 and set(m.tiers) == {pb.TIER_CLUSTER}
    assert await cb.load(m.lease_id) == bs
    await cb.release(m.lease_id)
    assert sum(a.cluster.client.faults.values()) == 0 == sum(b.cluster.client.faults.values())
    a.ledger.check_invariants()
    b.ledger.check_invariants()
    await ca.close()
    await cb.close()


async def test_a_tls_cluster_without_its_ca_stops_start_up_naming_the_key(daemon_config,
                                                                          tls_cluster, prefix):
    cluster, good = tls_cluster
    err = start_fails(daemon_config, **cluster_cfg(cluster.url, prefix,
                                                   ca_file=str(good.parent / "other" / "ca.pem")))
    assert err.key == "cluster_tier.ca_file"
