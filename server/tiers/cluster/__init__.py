"""Cluster tier: blocks in a Redis/Valkey server or cluster that the daemons of
many hosts share, below the host and disk tiers ([cluster_tier] url = ...).

One concept per module:

    config    the [cluster_tier] URL syntax, ClusterSettings, the secret files
    format    a block's value (header + payload) and its Redis key
    client    the redis.asyncio client behind a per-call deadline; faults by kind
    probe     the chain probe: one pipelined STRLEN round trip per node
    tier      ClusterTier, the stack's LowerTier; its counters
    settings  from the daemon's Config to an open ClusterTier (start-up errors)

The API other parts of the daemon use (metrics, status, benchmarks):

* ``daemon.cluster`` (app.Daemon) is the ClusterTier, or None without one.
* ``ClusterTier.counters()`` -> list of stack.TierCounter, exported by
  metrics.py as ``kvkeeper_<name>[_total]``; the names, kinds and help texts
  are ``tier.SERIES`` (hits, misses, bytes read and written, dropped writes,
  corrupt values, vanished blocks, probes, probed keys, timeouts, calls
  skipped while unreachable, reconnects, up, used_memory, maxmemory)
  plus ``cluster_errors_total{kind=...}`` over ``client.FAULT_KINDS``.
* The same values as attributes: ``tier.hits``, ``tier.misses``,
  ``tier.read_bytes``, ``tier.written_bytes``, ``tier.written_blocks``,
  ``tier.flush_failures`` (dropped writes), ``tier.corrupt``,
  ``tier.vanished``, ``tier.used_memory``, ``tier.maxmemory``;
  ``tier.client.faults`` (a Counter by kind), ``tier.client.reconnects``,
  ``tier.client.skipped``, ``tier.client.up``; ``await tier.refresh_memory()``
  reads used_memory/maxmemory now (maintain() does it every 10 s).
* The ledger's book of the tier (``ledger.lower["cluster"]``, in TierStats and
  `kvkeeper status`) holds only the copies being moved: its capacity is a
  placeholder (tier.BOOK_BYTES) and its used bytes are in flight; the
  cluster's own memory is the gauges above.
* ``ClusterTier.errors()`` -> {"faults", "corrupt_values", "dropped_writes"}:
  what ops/watch.py logs when it grows.
* Moving bytes as the stack does: ``loc = tier.loc(ns, key, nbytes)``, then
  ``await tier.write_block(src_store, src_loc, loc, checksum)`` and
  ``await tier.read_block(loc, dst_store, dst_loc)`` (BlockStores such as
  the arena's backend); ``await tier.probe_run(ns, keys)`` -> the payload
  sizes of the leading blocks the cluster holds.
* ``format.encode`` / ``format.decode`` / ``format.redis_key``: the value
  format and key naming, for tools and benchmarks that talk to Redis directly.

Importers take names from the modules (``from kvkeeper.server.tiers.cluster.tier
import ClusterTier``): this package imports nothing, so the config package can
use ``config`` without loading the redis client.
"""
