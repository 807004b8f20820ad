"""Prometheus metrics of the daemon.

Two kinds of series, all named `kvkeeper_*` in base units (seconds, bytes):

* Ledger state (capacity, hits, evictions, sessions...) is read from the
  ledger at scrape time by `LedgerCollector`; the ledger's own counters are
  the only copy of those numbers.
* RPC and transfer timings are owned here, updated by the servicer through
  `Metrics.observe_rpc` and `Metrics.observe_transfer`.

Every series exists, at zero, from start-up: label values come from fixed
lists (tiers, eviction reasons, RPC methods, status codes, directions,
transports), never from keys, hashes, sessions or request ids.

Thread safety: the HTTP exporter serves scrapes from its own thread while the
asyncio loop mutates the ledger. The collector therefore only reads scalar
attributes, `len()` and `dict.get` of the ledger; it never iterates a dict or
Counter that the loop may grow (which could raise "dictionary changed size
during iteration"). Numbers read in one scrape may straddle a ledger call;
that is fine for monitoring.
"""
from __future__ import annotations

import time
from typing import TYPE_CHECKING, Any, Iterable, Iterator, Optional, Sequence

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from kvkeeper.client.url import parse_host_port

from .ledger import EVICTION_REASONS
from .ledger.sessions import END_REASONS
from .ledger.views import tier_stats
from .metrics_residency import residency_families
from .version import package_version

if TYPE_CHECKING:  # pragma: no cover
    from .ledger import Ledger

# `_created` series double the series count and no dashboard uses them.
prometheus_client.disable_created_metrics()

PREFIX = "kvkeeper_"

# The RPCs of service kvkeeper.v1.KVKeeper, in proto order.
RPC_METHODS: tuple[str, ...] = (
    "RegisterSession", "Heartbeat", "CloseSession", "Match", "Load", "LoadStream",
    "ReserveSave", "WriteBlocks", "CommitSave", "AbortSave", "Release", "Stats",
    "WatchSession",
)
# The RPCs of service kvkeeper.v1.KVKeeperResidency (residency.proto), in proto order.
RESIDENCY_RPC_METHODS: tuple[str, ...] = ("ReportResidency", "Locate", "WatchEvents")
# Calls held open for a client's lifetime: their errors count, they have no duration.
HELD_RPC_METHODS: tuple[str, ...] = ("WatchSession", "WatchEvents")
# The RPCs of service kvkeeper.v1.KVKeeperAdmin, in proto order.
ADMIN_RPC_METHODS: tuple[str, ...] = (
    "ListNamespaces", "InspectBlock", "Evict", "Drain", "Verify",
)
# Non-OK codes the daemon answers with, pre-created at zero. Other gRPC code
# names are accepted (bounded set) and appear on first use.
RPC_ERROR_CODES: tuple[str, ...] = (
    "INVALID_ARGUMENT", "NOT_FOUND", "FAILED_PRECONDITION", "OUT_OF_RANGE",
    "RESOURCE_EXHAUSTED", "UNAVAILABLE", "INTERNAL", "CANCELLED", "DEADLINE_EXCEEDED",
    "UNAUTHENTICATED",
)
GRPC_CODES: frozenset[str] = frozenset(RPC_ERROR_CODES) | {
    "OK", "UNKNOWN", "ALREADY_EXISTS", "PERMISSION_DENIED", "ABORTED", "UNIMPLEMENTED",
    "DATA_LOSS",
}
DIRECTIONS: tuple[str, ...] = ("save", "load")
TRANSPORTS: tuple[str, ...] = ("shm", "stream")
BLOCK_STATES: tuple[str, ...] = ("committed", "pending")

# 50 us .. 10 s, roughly 1-2.5-5 per decade.
RPC_BUCKETS: tuple[float, ...] = (
    0.00005, 0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05,
    0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0,
)
TRANSFER_BUCKETS: tuple[float, ...] = RPC_BUCKETS


class LedgerCollector:
    """Reads the ledger at scrape time. See the module docstring on thread safety."""

    def __init__(self, ledger: "Ledger", started_at: float, version: str) -> None:
        self._ledger = ledger
        self._started_at = float(started_at)
        self._version = version
        # The tier stack once attached: its tiers' books and their own counters.
        self.stack: Any = None

    # -- families, empty; describe() returns them so the registry can detect clashes
    def _families(self) -> dict[str, Metric]:
        c, g = CounterMetricFamily, GaugeMetricFamily
        p = PREFIX
        tier, tr = ["tier"], ["tier", "reason"]
        fams = [
            g(p + "up", "1 while the daemon serves."),
            g(p + "build_info", "Build of the daemon; always 1.", labels=["version"]),
            g(p + "start_time_seconds", "Start time of the daemon, seconds since the Unix epoch."),
            c(p + "lookups", "Match calls answered."),
            c(p + "lookup_keys", "Keys named by Match calls, blocks clients hold themselves included."),
            c(p + "lookup_blocks", "Blocks asked of the daemon beyond what the clients hold "
              "themselves (vLLM's own prefix cache)."),
            c(p + "lookup_tokens", "Tokens of the blocks asked beyond the clients' own caches "
              "(TP rank 0 only)."),
            c(p + "prompt_blocks", "Full blocks of the prompts clients reported looking up."),
            c(p + "prompt_tokens", "Tokens of the prompts clients reported looking up "
              "(TP rank 0 only)."),
            c(p + "hit_blocks", "Blocks clients loaded from the daemon (a Match without "
              "report_use: blocks it found).", labels=tier),
            c(p + "hit_tokens", "Tokens of the blocks clients loaded, whole blocks "
              "(TP rank 0 only).", labels=tier),
            c(p + "saved_blocks", "Blocks committed by CommitSave.", labels=tier),
            c(p + "saved_bytes", "Bytes of blocks committed by CommitSave.", labels=tier),
            c(p + "evictions", "Blocks dropped from a tier, by reason: evicted for room "
              "(capacity; demoted: a lower tier keeps a copy), removed on request (admin, "
              "discarded), never committed (aborted, reservation_timeout), or found damaged "
              "or gone (corrupt, lost).", labels=tr),
            c(p + "admission_refused", "New blocks a tier's admission turned away: on the host "
              "tier a long run of blocks nobody saved lately that would have evicted (a one-off "
              "document; ReserveSave answers SLOT_NOT_ADMITTED), on the disk tier a copy never "
              "hit above bound for a full disk, the first time it came.", labels=tier),
            c(p + "last_turn_blocks", "Blocks a conversation's last turn read, put first in "
              "line for eviction when released (Release with last_turn; a hit undoes it).",
              labels=tier),
            g(p + "tier_capacity_bytes", "Capacity of the tier.", labels=tier),
            g(p + "tier_used_bytes", "Bytes of the tier's pages held by blocks, or kept out of use "
              "a while after a save reservation the daemon ended.", labels=tier),
            g(p + "tier_pinned_bytes",
              "Bytes of the tier that eviction cannot take (leased, being written, or kept "
              "out of use after a save reservation the daemon ended).",
              labels=tier),
            g(p + "tier_evictable_bytes", "Bytes of the tier held by unreferenced committed blocks.",
              labels=tier),
            g(p + "tier_page_size_bytes", "Size of one page of the tier.", labels=tier),
            g(p + "tier_capacity_pages", "Pages of the tier.", labels=tier),
            g(p + "tier_used_pages", "Pages of the tier held by blocks.", labels=tier),
            g(p + "tier_blocks", "Blocks in the tier, by state.", labels=["tier", "state"]),
            g(p + "sessions", "Live sessions."),
            g(p + "leases", "Open leases."),
            g(p + "reservations", "Open save reservations."),
            g(p + "namespaces", "Namespaces known to the ledger."),
            c(p + "sessions_expired", "Sessions dropped for a missed heartbeat."),
            c(p + "sessions_ended", "Sessions ended, by reason: closed by their client, "
              "expired (missed heartbeats), or disconnected (the call watching the session "
              "ended: its client is gone) or revoked (a reload took its model from its token).",
              labels=["reason"]),
            c(p + "reservations_timed_out", "Save reservations dropped uncommitted after their timeout."),
        ]
        return {f.name: f for f in fams}

    def describe(self) -> Iterable[Metric]:
        return list(self._families().values())

    def collect(self) -> Iterator[Metric]:
        L = self._ledger
        f = self._families()
        p = PREFIX

        def fam(name: str) -> Metric:
            # Counter families drop the `_total` suffix from .name.
            return f[p + name]

        fam("up").add_metric([], 1)
        fam("build_info").add_metric([self._version], 1)
        fam("start_time_seconds").add_metric([], self._started_at)
        fam("lookups").add_metric([], L.lookups)
        fam("lookup_keys").add_metric([], L.lookup_keys)
        u = L.usage
        fam("lookup_blocks").add_metric([], u.lookup_blocks)
        fam("lookup_tokens").add_metric([], u.lookup_tokens)
        fam("prompt_blocks").add_metric([], u.prompt_blocks)
        fam("prompt_tokens").add_metric([], u.prompt_tokens)
        fam("sessions_expired").add_metric([], L.sessions_expired)
        ends = L.session_ends
        for reason in END_REASONS:
            fam("sessions_ended").add_metric([reason], ends.get(reason, 0))
        fam("reservations_timed_out").add_metric([], L.reservations_timed_out)
        fam("sessions").add_metric([], len(L.sessions))
        fam("leases").add_metric([], len(L.leases))
        fam("reservations").add_metric([], len(L.reservations))
        fam("namespaces").add_metric([], len(L.namespaces))
        stack = self.stack
        for t in (stack.tier_stats() if stack is not None else tier_stats(L)):
            name = str(t.name)
            fam("hit_blocks").add_metric([name], t.hit_blocks)
            fam("hit_tokens").add_metric([name], t.hit_tokens)
            fam("saved_blocks").add_metric([name], t.saved_blocks)
            fam("saved_bytes").add_metric([name], t.saved_bytes)
            for reason in EVICTION_REASONS:
                fam("evictions").add_metric([name, reason], t.evictions[reason])
            fam("admission_refused").add_metric([name], t.admission_refused)
            fam("last_turn_blocks").add_metric([name], t.last_turn_demoted)
            fam("tier_capacity_bytes").add_metric([name], t.capacity_bytes)
            fam("tier_used_bytes").add_metric([name], t.used_bytes)
            fam("tier_pinned_bytes").add_metric([name], t.pinned_bytes)
            fam("tier_evictable_bytes").add_metric([name], t.evictable_bytes)
            if t.page_bytes:
                # Pages and block states are what page tiers keep; byte tiers have neither.
                fam("tier_page_size_bytes").add_metric([name], t.page_bytes)
                fam("tier_capacity_pages").add_metric([name], t.capacity_pages)
                fam("tier_used_pages").add_metric([name], t.used_pages)
                fam("tier_blocks").add_metric([name, "committed"],
                                              max(0, t.blocks - t.pending_blocks))
                fam("tier_blocks").add_metric([name, "pending"], t.pending_blocks)
        out = list(f.values())
        out += residency_families(L.residency)
        if stack is not None:
            # The tiers' own series (disk I/O, recovery ...), declared by each tier.
            tier_families: dict[str, Any] = {}
            for tc in stack.counters():
                family = tier_families.get(tc.name)
                if family is None:
                    kind = CounterMetricFamily if tc.kind == "counter" else GaugeMetricFamily
                    family = tier_families[tc.name] = kind(p + tc.name, tc.help,
                                                           labels=[k for k, _ in tc.labels])
                    out.append(family)
                family.add_metric([v for _, v in tc.labels], tc.value)
        return iter(out)


class _HttpExporter:
    """The running /metrics HTTP server; `close()` stops it."""

    def __init__(self, server: Any, thread: Any) -> None:
        self._server = server
        self._thread = thread
        addr = server.server_address
        self.host: str = addr[0]
        self.port: int = addr[1]

    def close(self) -> None:
        if self._server is None:
            return
        server, self._server = self._server, None
        server.shutdown()
        server.server_close()
        self._thread.join(timeout=5)

    def __enter__(self) -> "_HttpExporter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _check(value: str, allowed: Sequence[str], what: str) -> str:
    if value not in allowed:
        raise ValueError(f"{what} {value!r} is not one of {', '.join(allowed)}")
    return value


class Metrics:
    """The daemon's metrics: one registry, the ledger collector, RPC and transfer timings."""

    def __init__(self, registry: Optional[CollectorRegistry] = None) -> None:
        if registry is None:
            registry = CollectorRegistry()
            # The daemon's own registry still carries the usual process_* / python_* series.
            prometheus_client.ProcessCollector(registry=registry)
            prometheus_client.PlatformCollector(registry=registry)
            prometheus_client.GCCollector(registry=registry)
        self.registry = registry
        self.version = package_version()
        self._collector: Optional[LedgerCollector] = None
        p = PREFIX
        self.rpc_duration = Histogram(
            p + "rpc_duration_seconds", "Time to answer an RPC, whatever its outcome.",
            ["method"], registry=registry, buckets=RPC_BUCKETS)
        self.rpc_errors = Counter(
            p + "rpc_errors_total", "RPCs answered with a non-OK status code.",
            ["method", "code"], registry=registry)
        self.transfer_bytes = Counter(
            p + "transfer_bytes_total", "Block bytes moved between clients and the daemon.",
            ["direction", "transport"], registry=registry)
        self.transfer_duration = Histogram(
            p + "transfer_duration_seconds", "Time to move the blocks of one save or load.",
            ["direction", "transport"], registry=registry, buckets=TRANSFER_BUCKETS)
        # Pre-create every child so each series exists at zero from start-up.
        self._rpc_hist = {m: self.rpc_duration.labels(method=m)
                          for m in RPC_METHODS + ADMIN_RPC_METHODS + RESIDENCY_RPC_METHODS
                          if m not in HELD_RPC_METHODS}
        self._rpc_err: dict[tuple[str, str], Any] = {
            (m, c): self.rpc_errors.labels(method=m, code=c)
            for m in RPC_METHODS for c in RPC_ERROR_CODES}
        self._xfer = {
            (d, t): (self.transfer_bytes.labels(direction=d, transport=t),
                     self.transfer_duration.labels(direction=d, transport=t))
            for d in DIRECTIONS for t in TRANSPORTS}

    # ------------------------------------------------------------ ledger
    def attach_ledger(self, ledger: "Ledger", started_at: Optional[float] = None) -> None:
        """Serve the ledger's state from now on.

        `started_at`: when the daemon started, on the `time.monotonic()` clock
        (the ledger's clock); None means now. It is exported as
        kvkeeper_start_time_seconds in Unix time, as Prometheus expects.
        """
        if self._collector is not None:
            raise RuntimeError("a ledger is already attached to these metrics")
        wall = time.time()
        if started_at is not None:
            wall -= max(0.0, time.monotonic() - started_at)
        collector = LedgerCollector(ledger, wall, self.version)
        self.registry.register(collector)
        self._collector = collector

    def attach_stack(self, stack: Any) -> None:
        """Also serve the tiers below the arena (kvkeeper.server.tiers.stack.TierStack)."""
        if self._collector is None:
            raise RuntimeError("attach a ledger first")
        self._collector.stack = stack

    def detach_ledger(self) -> None:
        if self._collector is not None:
            self.registry.unregister(self._collector)
            self._collector = None

    # ------------------------------------------------------------ servicer hooks
    def observe_rpc(self, method: str, seconds: Optional[float], code: Any = None) -> None:
        """One answered RPC. `code`: None or "OK" for success, else a gRPC code
        name or grpc.StatusCode. `seconds` None: only the code counts (a call
        held open for a client's lifetime takes no time to answer). Raises
        ValueError on a method or code outside the fixed sets, so a typo cannot
        mint a new series."""
        hist = self._rpc_hist.get(method)
        if hist is None:
            _check(method, RPC_METHODS + ADMIN_RPC_METHODS + RESIDENCY_RPC_METHODS,
                   "RPC method")
        if seconds is not None:
            if hist is None:
                raise ValueError(f"{method} is held open for a client's lifetime: it has no "
                                 "duration to observe")
            hist.observe(max(0.0, seconds))
        if code is None:
            return
        name = getattr(code, "name", code)
        if name == "OK":
            return
        child = self._rpc_err.get((method, name))
        if child is None:
            _check(name, sorted(GRPC_CODES), "gRPC status code")
            child = self._rpc_err[(method, name)] = self.rpc_errors.labels(method=method, code=name)
        child.inc()

    def observe_transfer(self, direction: str, transport: str, nbytes: int,
                         seconds: Optional[float]) -> None:
        """One save or load of blocks: `direction` "save"|"load", `transport` "shm"|"stream".

        `seconds` is None when the daemon cannot see the copy (a same-host
        client reading the arena): the bytes count, no duration is invented."""
        pair = self._xfer.get((direction, transport))
        if pair is None:
            _check(direction, DIRECTIONS, "transfer direction")
            _check(transport, TRANSPORTS, "transport")
        counter, hist = pair
        if nbytes < 0:
            raise ValueError(f"negative transfer size {nbytes}")
        counter.inc(nbytes)
        if seconds is not None:
            hist.observe(max(0.0, seconds))

    # ------------------------------------------------------------ exposition
    def render(self) -> bytes:
        """The registry in the Prometheus text format (what /metrics serves)."""
        return generate_latest(self.registry)

    def start_http(self, address: str) -> _HttpExporter:
        """Serve /metrics on "host:port" from a daemon thread. Port 0 picks a free
        port; the returned object's `.port` says which. Call `.close()` to stop."""
        try:
            host, port = parse_host_port(address, any_port=True)
        except ValueError as e:
            raise ValueError(f"metrics address {address!r}: {e}") from None
        started = prometheus_client.start_http_server(port, addr=host, registry=self.registry)
        if started is None:  # pragma: no cover - prometheus_client < 0.20
            raise RuntimeError("prometheus_client>=0.20 is needed (start_http_server returns the server)")
        server, thread = started
        return _HttpExporter(server, thread)
