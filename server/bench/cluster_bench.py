"""Cluster tier: save and load GB/s through the tier against raw `redis`
client SET and GET of the same bytes, and the chain probe against one raw
pipelined EXISTS of the same keys, in the same run.

The benchmark starts its own redis-server on loopback (redis_procs.py; with
`--redis-cluster` also a Redis Cluster of three masters and three replicas)
and talks to it through both sides with the same client library (`redis`'s
asyncio client) and the same number of blocks in flight.

* Save: the tier's write of a block from a host-arena buffer (header with
  magic, version, namespace digest, key, length and checksum, then the
  payload, one SET) against a raw SET of the same payload under a key of the
  same length. Load: the tier's read of the block into a host buffer (GET,
  header and checksum check, copy into place) against a raw GET of the same
  bytes (the bytes object redis-py returns, not copied anywhere: the stricter
  baseline). Target >= 0.8x for both (issue 16). Both sides take turns a few
  blocks at a time (SLICE) so that a shared machine's load hits both alike;
  round 0 warms up and the median of the remaining rounds is reported.
* Probe: the tier's chain probe of 256 stored keys (one pipelined round trip
  per cluster node) against one raw pipeline of 256 EXISTS, p50 over many
  repetitions taken in alternation. Informational (the issue sets no target).
"""
from __future__ import annotations

import asyncio
import os
import time
from typing import Any, Awaitable, Callable, Optional, Sequence

import numpy as np

from .registry import BenchUnavailable
from .result import Result, median, percentile
from .sizes import KiB, MiB, size_label

SLICE = 8             # blocks per side per turn, and blocks in flight
PROBE_KEYS = 256
IO_TARGET = ">= 0.8"  # issue 16
KEY_PREFIX_RAW = b"kvkbench:raw:"


class Scale:
    def __init__(self, quick: bool, tiny: bool = False) -> None:
        self.block_sizes = (256 * KiB, 1 * MiB, 4 * MiB)
        if tiny:   # the unit test: rows, not figures
            self.block_sizes = (64 * KiB,)
            self.move_bytes, self.rounds, self.probe_reps = 512 * KiB, 1, 5
        elif quick:
            self.move_bytes, self.rounds, self.probe_reps = 16 * MiB, 1, 50
        else:
            self.move_bytes, self.rounds, self.probe_reps = 96 * MiB, 3, 400


def _redis_module() -> Any:
    try:
        import redis.asyncio as aioredis
    except ImportError as e:
        raise BenchUnavailable("it needs the `redis` package (pip install 'kvkeeper[cluster]')"
                               ) from e
    return aioredis


# --------------------------------------------------------------------------- raw side
class RawSide:
    """Bare redis-py asyncio calls: SET, GET, a pipeline of EXISTS."""

    def __init__(self, client: Any) -> None:
        self.r = client

    @staticmethod
    def keys(n: int, rnd: int) -> list[bytes]:
        return [KEY_PREFIX_RAW + b"%d:%d" % (rnd, i) for i in range(n)]

    async def save(self, keys: Sequence[bytes], blocks: Sequence[Any]) -> None:
        await asyncio.gather(*(self.r.set(k, memoryview(b)) for k, b in zip(keys, blocks)))

    async def load(self, keys: Sequence[bytes], outs: Sequence[Any]) -> None:
        got = await asyncio.gather(*(self.r.get(k) for k in keys))
        if any(g is None for g in got):
            raise RuntimeError("a raw GET found no value: the server dropped keys mid-run")

    async def probe(self, keys: Sequence[bytes]) -> int:
        pipe = self.r.pipeline(transaction=False)
        for k in keys:
            pipe.exists(k)
        found = await pipe.execute()
        n = 0
        while n < len(found) and found[n]:
            n += 1
        return n


async def _interleaved(sides: list[tuple[str, Callable[[int, int], Awaitable[Any]]]], n: int,
                       rnd: int, times: dict[str, list[float]]) -> None:
    """Each side's fn(start, stop) slice by slice, which side goes first
    alternating; round 0 only warms up."""
    total = {k: 0.0 for k, _ in sides}
    for j, start in enumerate(range(0, n, SLICE)):
        for k, fn in (sides if (rnd + j) % 2 == 0 else sides[::-1]):
            t0 = time.perf_counter()
            await fn(start, min(n, start + SLICE))
            total[k] += time.perf_counter() - t0
    if rnd:
        for k, dt in total.items():
            times[k].append(dt)


async def _throughput(tier: Any, raw: RawSide, flush: Callable[[], Awaitable[Any]],
                      scale: Scale, where: str, log: Callable[[str], None]) -> list[Result]:
    results = []
    rng = np.random.default_rng(0)
    for size in scale.block_sizes:
        n = max(SLICE, scale.move_bytes // size)
        blocks = [rng.integers(0, 256, size, dtype=np.uint8) for _ in range(n)]
        t: dict[str, list[float]] = {"ts": [], "rs": [], "tl": [], "rl": []}
        for rnd in range(scale.rounds + 1):
            await flush()
            rk = raw.keys(n, rnd)
            tk = tier.keys(n, rnd)
            handles = tier.prepare(tk, blocks)
            await _interleaved([
                ("ts", lambda a, b: tier.save(handles[a:b])),
                ("rs", lambda a, b: raw.save(rk[a:b], blocks[a:b]))], n, rnd, t)
            await _interleaved([
                ("tl", lambda a, b: tier.load(handles[a:b])),
                ("rl", lambda a, b: raw.load(rk[a:b], blocks[a:b]))], n, rnd, t)
            tier.check(handles, blocks)
        nbytes = n * size
        gbps = {k: nbytes / median(v) / 1e9 for k, v in t.items()}
        label = size_label(size)
        params = {"block_bytes": size, "blocks": n, "in_flight": SLICE, "rounds": scale.rounds,
                  "server": where}
        results.append(Result(
            f"cluster.save_gbps.{label}{tier.suffix}", gbps["ts"], "GB/s",
            "raw redis-py SET of the same bytes", gbps["rs"], "higher", IO_TARGET,
            params=params, note="cluster tier write: header + checksum + SET"))
        results.append(Result(
            f"cluster.load_gbps.{label}{tier.suffix}", gbps["tl"], "GB/s",
            "raw redis-py GET of the same bytes (not copied)", gbps["rl"], "higher", IO_TARGET,
            params=params, note="cluster tier read: GET, header + checksum check, copy in"))
        log(f"cluster {where} {label}: save {gbps['ts']:.2f} vs {gbps['rs']:.2f} GB/s, "
            f"load {gbps['tl']:.2f} vs {gbps['rl']:.2f} GB/s")
    return results


async def _probe(tier: Any, raw: RawSide, flush: Callable[[], Awaitable[Any]], scale: Scale,
                 where: str, log: Callable[[str], None]) -> list[Result]:
    await flush()
    payload = np.zeros(4 * KiB, dtype=np.uint8)
    tk = tier.keys(PROBE_KEYS, 0)
    handles = tier.prepare(tk, [payload] * PROBE_KEYS)
    rk = raw.keys(PROBE_KEYS, 0)
    for a in range(0, PROBE_KEYS, SLICE):
        await tier.save(handles[a:a + SLICE])
        await raw.save(rk[a:a + SLICE], [payload] * len(rk[a:a + SLICE]))
    samples: dict[str, list[float]] = {"t": [], "r": []}
    for i in range(scale.probe_reps + 1):
        order = (("t", lambda: tier.probe(handles)), ("r", lambda: raw.probe(rk)))
        for k, fn in (order if i % 2 == 0 else order[::-1]):
            t0 = time.perf_counter()
            found = await fn()
            dt = time.perf_counter() - t0
            if found != PROBE_KEYS:
                raise RuntimeError(f"the {k} probe found {found} of {PROBE_KEYS} stored keys")
            if i:
                samples[k].append(dt * 1e6)
    p50 = {k: percentile(v, 50) for k, v in samples.items()}
    log(f"cluster {where} probe of {PROBE_KEYS} keys: p50 {p50['t']:.0f} us "
        f"vs raw pipelined EXISTS {p50['r']:.0f} us")
    return [Result(
        f"cluster.probe_p50_us.{PROBE_KEYS}{tier.suffix}", p50["t"], "us",
        f"one raw pipeline of {PROBE_KEYS} EXISTS", p50["r"], "lower",
        params={"keys": PROBE_KEYS, "reps": scale.probe_reps, "server": where},
        note="the tier's chain probe: pipelined EXISTS per cluster node, leading run")]


async def _run_against(url: str, raw_client: Any, where: str, scale: Scale,
                       log: Callable[[str], None]) -> list[Result]:
    from .cluster_side import TierSide   # the tier's side: needs the cluster tier

    raw = RawSide(raw_client)
    tier = await TierSide.open(url, where, max_keys_per_call=PROBE_KEYS)

    async def flush() -> None:   # between rounds: both sides start from an empty server
        await raw_client.flushall()

    try:
        results = (await _throughput(tier, raw, flush, scale, where, log)
                   + await _probe(tier, raw, flush, scale, where, log))
        if tier.faults():
            raise RuntimeError(f"the cluster tier met {tier.faults()} faults: its figures "
                               "would count dropped writes as fast ones")
        return results
    finally:
        await flush()
        await tier.close()


async def _single(scale: Scale, log: Callable[[str], None]) -> list[Result]:
    from .redis_procs import RedisServer

    aioredis = _redis_module()
    with RedisServer() as server:
        client = aioredis.Redis(host="127.0.0.1", port=server.port)
        try:
            return await _run_against(server.url, client, "single", scale, log)
        finally:
            await client.aclose()


async def _cluster(scale: Scale, log: Callable[[str], None]) -> list[Result]:
    from .redis_procs import RedisClusterProcs

    aioredis = _redis_module()
    with RedisClusterProcs() as procs:
        nodes = [aioredis.cluster.ClusterNode(h, p) for h, p in procs.startup_nodes]
        client = aioredis.RedisCluster(startup_nodes=nodes)
        await client.initialize()
        try:
            return await _run_against(procs.url, client, "cluster", scale, log)
        finally:
            await client.aclose()


def run(quick: bool = False, *, log: Callable[[str], None] = lambda s: None,
        redis_cluster: Optional[bool] = None, tiny: bool = False) -> list[Result]:
    """redis_cluster: also run against a 3x2 Redis Cluster (default:
    $KVKEEPER_BENCH_REDIS_CLUSTER=1)."""
    from .redis_procs import RedisUnavailable, server_binary

    _redis_module()
    try:
        server_binary()
    except RedisUnavailable as e:
        raise BenchUnavailable(str(e)) from None
    if redis_cluster is None:
        redis_cluster = os.environ.get("KVKEEPER_BENCH_REDIS_CLUSTER", "") == "1"
    scale = Scale(quick, tiny)
    results = asyncio.run(_single(scale, log))
    if redis_cluster:
        results += asyncio.run(_cluster(scale, log))
    return results
