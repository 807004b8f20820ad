"""The cluster tier below the host (and disk) tier: blocks in a Redis/Valkey
server or cluster that the daemons of many hosts share.

It plugs into the stack as any LowerTier does, with one difference the
stack knows by `keeps_book = False`: the cluster decides what it keeps (its
maxmemory policy), so the daemon keeps no mirror of it. The ledger's book of
this tier holds only the copies being moved (a flush, a promotion) and every
lookup probes the cluster (probe.py); a found block is booked, promoted into
the arena under the lease as a disk hit is, and forgotten again.

Faults are misses: a node down, slow, failing over or refusing writes (OOM,
READONLY) makes a probe find nothing, a read a miss, a write dropped; each is
counted (client.py) and none reaches a client. A value that vanished between
probe and read is a miss; one that fails its checks (format.py) is deleted,
counted and a miss.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections import OrderedDict
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Callable, NamedTuple, Optional, Sequence

from ...errors import ClientError
from ...ids import CLUSTER, TierName
from ...ledger import Ledger
from ..backend import BlockStore, Checksum, NotStored, TierError
from ..stack import TierCounter
from .client import FAULT_KINDS, ClusterClient, ClusterFault, first_contact
from .config import ClusterSettings, check_tls_files, read_password
from .format import CorruptValue, decode, redis_key, seal, value_buffer
from .probe import probe_chain

log = logging.getLogger("kvkeeper.cluster")

# The book only holds copies in flight; its size is no limit (the cluster's maxmemory is).
BOOK_BYTES = 1 << 50
# Admission would send a hot block again on every hit past admit_after_hits
# (the book forgets copies once moved): blocks moved this recently are not sent again.
RECENT_BLOCKS = 65536
RECENT_S = 300.0

# What the tier exports beside its book: (name, kind, help), see counters().
SERIES: tuple[tuple[str, str, str], ...] = (
    ("cluster_hit_blocks", "counter", "Blocks read from the cluster tier into the arena."),
    ("cluster_miss_blocks", "counter", "Blocks looked for in the cluster tier and not served: "
     "the first missing block of each probe, values vanished or corrupt, reads that failed."),
    ("cluster_read_bytes", "counter", "Bytes read from the cluster tier (values, headers included)."),
    ("cluster_written_bytes", "counter", "Bytes written to the cluster tier (values, headers included)."),
    ("cluster_written_blocks", "counter", "Blocks written to the cluster tier."),
    ("cluster_dropped_writes", "counter", "Blocks that could not be written to the cluster tier."),
    ("cluster_corrupt_values", "counter", "Cluster values that failed their checks (deleted, never served)."),
    ("cluster_vanished_blocks", "counter", "Blocks a probe found that were gone when read."),
    ("cluster_probes", "counter", "Chain probes sent to the cluster (one pipelined call each)."),
    ("cluster_probed_keys", "counter", "Keys the chain probes asked the cluster about."),
    ("cluster_timeouts", "counter", "Cluster calls that ran past cluster_tier.timeout_seconds."),
    ("cluster_skipped_calls", "counter", "Cluster calls not sent while it was unreachable (one "
     "a second tries): misses or dropped writes at once."),
    ("cluster_reconnects", "counter", "Times the cluster answered again after connection faults."),
    ("cluster_up", "gauge", "1 while the cluster's last call reached it, else 0."),
    ("cluster_used_memory_bytes", "gauge", "used_memory the cluster's masters report, summed."),
    ("cluster_maxmemory_bytes", "gauge", "maxmemory of the cluster's masters, summed (0: none set)."),
)
FAULTS_SERIES = ("cluster_errors", "counter", "Failed cluster calls, by kind of fault.")


class ClusterLoc(NamedTuple):
    ns: bytes
    key: bytes
    nbytes: int
    rkey: bytes     # the Redis key


class RecentBlocks:
    """Blocks this daemon moved to or from the cluster lately (bounded, aging
    out): used only to skip sending one again, never to answer a lookup."""

    def __init__(self, size: int = RECENT_BLOCKS, ttl_s: float = RECENT_S) -> None:
        self.size, self.ttl_s = size, ttl_s
        self._at: OrderedDict[bytes, float] = OrderedDict()

    def mark(self, rkey: bytes, now: float) -> None:
        self._at[rkey] = now
        self._at.move_to_end(rkey)
        while len(self._at) > self.size:
            self._at.popitem(last=False)

    def fresh(self, rkey: bytes, now: float) -> bool:
        at = self._at.get(rkey)
        return at is not None and now - at < self.ttl_s


def check_startup(settings: ClusterSettings, password: Optional[str]) -> Optional[str]:
    """first_contact on a loop of its own, in a thread (the daemon's loop may be
    running: start-up blocks as the disk tier's recovery does). ClusterConfigError
    for a configuration the cluster refuses; else None, or why it is unreachable."""
    with ThreadPoolExecutor(1, thread_name_prefix="kvkeeper-cluster-check") as ex:
        return ex.submit(asyncio.run, first_contact(settings, password)).result()


class ClusterTier:
    """One lower tier of the stack (see stack.LowerTier and the module docstring)."""

    name: TierName = CLUSTER
    keeps_book = False

    def __init__(self, settings: ClusterSettings, client: ClusterClient, *,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.settings = settings
        self.client = client
        self.prefix = settings.prefix
        self.write_back = settings.write_back
        self.admit_after_hits = settings.admit_after_hits
        self.clock = clock
        self.flush_failures = 0
        self.recent = RecentBlocks()
        self.hits = self.misses = 0
        self.read_bytes = self.written_bytes = self.written_blocks = 0
        self.corrupt = self.vanished = self.probes = self.probed_keys = 0
        self.used_memory = self.maxmemory = 0
        self._last_poll = -1e18
        self._task: Optional[asyncio.Task[None]] = None   # maintain()'s background work

    @classmethod
    def open(cls, ledger: Ledger, settings: ClusterSettings) -> "ClusterTier":
        """Check the settings against the cluster (blocking: start-up only) and
        give the ledger the tier's book. ClusterConfigError naming the key of a
        setting the cluster refuses (credentials, TLS); an unreachable cluster
        is only logged: the tier serves misses until it answers."""
        check_tls_files(settings)
        password = read_password(settings.password_file)
        unreachable = check_startup(settings, password)
        if unreachable:
            log.warning("cluster tier %s unreachable at start-up (%s); lookups miss until it "
                        "answers", settings.url.show(), unreachable,
                        extra={"event": "cluster_unreachable"})
        else:
            log.info("cluster tier %s: connected (write %s, timeout %gs, prefix %r)",
                     settings.url.show(), "back" if settings.write_back else "through",
                     settings.timeout_s, settings.key_prefix)
        ledger.add_book(cls.name, BOOK_BYTES)
        tier = cls(settings, ClusterClient(settings, password))
        tier.client.up = not unreachable
        try:
            asyncio.get_running_loop()
        except RuntimeError:
            return tier   # no loop yet: maintain() settles it once the daemon runs
        tier._spawn(tier._settle())
        return tier

    # ------------------------------------------------------------ moving bytes
    def loc(self, ns: bytes, key: bytes, nbytes: int) -> ClusterLoc:
        if nbytes <= 0:
            raise ValueError(f"a block has at least one byte, got nbytes={nbytes}")
        rkey = redis_key(self.prefix, ns, key)   # ValueError on a bad ns or key
        return ClusterLoc(bytes(ns), bytes(key), nbytes, rkey)

    async def probe_run(self, ns: bytes, keys: Sequence[bytes]) -> list[Optional[int]]:
        """The payload size of each of the first max_keys_per_call keys the
        cluster holds now, None for those it lacks (one pipelined call); []
        on a fault. A probe whose leading run stops short counts one miss."""
        asked = min(len(keys), self.settings.max_keys_per_call)
        self.probes += 1
        self.probed_keys += asked
        sizes = await probe_chain(self.client, self.prefix, ns, keys, asked)
        if asked and (len(sizes) < asked or None in sizes):
            self.misses += 1
        return sizes

    async def read_block(self, loc: ClusterLoc, dst: BlockStore[Any],
                         dst_loc: Any) -> Optional[Checksum]:
        """GET the value, check it is this block intact, copy its payload into
        `dst`; the writer's checksum it kept. NotStored when it vanished,
        CorruptValue (deleted) when it fails a check, ClusterFault on a fault."""
        try:
            raw = await self.client.get(loc.rkey)
        except ClusterFault:
            self.misses += 1
            raise
        if raw is None:
            self.misses += 1
            self.vanished += 1
            raise NotStored("the cluster no longer holds the block (evicted or deleted)")
        self.read_bytes += len(raw)
        try:
            payload, kept = decode(raw, loc.ns, loc.key, loc.nbytes)
        except CorruptValue as e:
            self.misses += 1
            self.corrupt += 1
            # A writer may have replaced it since the GET: deleting a good value
            # then costs one later miss, never bad data.
            await self._delete(loc)
            raise CorruptValue(f"cluster value {loc.rkey.decode()} deleted: {e}") from None
        into = dst.view(dst_loc)
        if into is not None:
            into[:] = payload
        else:
            dst.write(dst_loc, payload, kept)
        self.hits += 1
        self.recent.mark(loc.rkey, self.clock())
        return kept

    async def write_block(self, src: BlockStore[Any], src_loc: Any, loc: ClusterLoc,
                          checksum: Optional[Checksum] = None) -> None:
        """SET the block's value (header + payload, one copy out of `src`);
        ClusterFault when the cluster did not take it (the stack counts it dropped)."""
        now = self.clock()
        if self.admit_after_hits and self.recent.fresh(loc.rkey, now):
            return   # moved lately: admission sees it hit again, the cluster has it
        buf, payload = value_buffer(loc.nbytes)
        out = src.view(src_loc)
        if out is not None:
            payload[:] = out
        else:
            src.read_into(src_loc, payload)
        seal(buf, loc.ns, loc.key, checksum)
        await self.client.set(loc.rkey, buf)
        self.written_bytes += len(buf)
        self.written_blocks += 1
        self.recent.mark(loc.rkey, now)

    async def _delete(self, loc: ClusterLoc) -> None:
        try:
            await self.client.delete(loc.rkey)
        except ClusterFault:
            pass   # counted; a later reader finds it corrupt again and retries

    @staticmethod
    def refusal(e: TierError) -> Optional[ClientError]:
        """None: a write the cluster did not take is dropped, the save stands."""
        return None

    async def forget(self, where: tuple[bytes, bytes]) -> None:
        """Nothing to delete: the cluster evicts by itself (the book never does)."""

    # ------------------------------------------------------------ upkeep
    async def maintain(self) -> None:
        """Periodic, in the background (the reaper must not wait on a slow
        cluster): while the cluster is unreachable or its slot map unknown,
        try to connect, so the tier is ready before the next lookup and
        cluster_up tells the truth without traffic; else poll its memory."""
        if self._task is not None and not self._task.done():
            return
        now = self.clock()
        if not self.client.settled:
            self._spawn(self._settle())
        elif now - self._last_poll >= self.settings.memory_poll_s:
            self._last_poll = now
            self._spawn(self.refresh_memory())

    def _spawn(self, work: Any) -> None:
        self._task = asyncio.get_running_loop().create_task(work)

    async def _settle(self) -> None:
        try:
            await self.client.settle()
        except ClusterFault:
            pass   # counted; tried again on the next tick

    async def refresh_memory(self) -> None:
        """Read the cluster's used_memory and maxmemory into the gauges."""
        try:
            self.used_memory, self.maxmemory = await self.client.memory()
        except ClusterFault:
            pass   # counted; the gauges keep the last answer

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
        await self.client.aclose()

    # ------------------------------------------------------------ counters
    def counters(self) -> list[TierCounter]:
        """The tier's series, read at scrape time (see SERIES), and the faults
        by kind (cluster_errors_total{kind=...})."""
        c = self.client
        values = (self.hits, self.misses, self.read_bytes, self.written_bytes,
                  self.written_blocks, self.flush_failures, self.corrupt, self.vanished,
                  self.probes, self.probed_keys, c.faults["timeout"], c.skipped, c.reconnects,
                  int(c.up), self.used_memory, self.maxmemory)
        out = [TierCounter(name, kind, text, v) for (name, kind, text), v in zip(SERIES, values)]
        name, kind, text = FAULTS_SERIES
        out += [TierCounter(name, kind, text, c.faults[k], (("kind", k),)) for k in FAULT_KINDS]
        return out

    def errors(self) -> dict[str, int]:
        """Error counters an operator is told about when they grow (watch.py)."""
        return {"faults": sum(self.client.faults.values()), "corrupt_values": self.corrupt,
                "dropped_writes": self.flush_failures}
