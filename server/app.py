"""Daemon assembly: ledger + tier stack (arena, tiers below) + servicer + admin + auth +
health + reflection + metrics.

Shape after grpc's own examples: `create_server(config)` returns
`(server, port)` with the TCP port actually bound (tests ask for port 0).
Shutdown order: health NOT_SERVING, refuse new RPCs, let in-flight ones
finish within the grace period, then release the tiers (every release step
runs, whatever failed before it). Running it as a process (signals, SIGHUP,
exit status): ops/process.py.
"""
from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import time
from dataclasses import replace
from typing import Any, Callable, Optional

import grpc
from grpc_health.v1 import health, health_pb2_grpc
from grpc_reflection.v1alpha import reflection, reflection_pb2_grpc

from kvkeeper.client.match_lane import lane_path
from kvkeeper.client.peer_wire import peer_socket_path
from kvkeeper.v1 import admin_pb2, admin_pb2_grpc, kvkeeper_pb2, kvkeeper_pb2_grpc, residency_pb2, residency_pb2_grpc

from .api.admin import AdminServicer
from .api.decoding import GenericOnly, add_guarded
from .api.health import SERVING, Health
from .api.match_lane import LaneCollector, MatchLaneServer
from .api.residency import ResidencyServicer
from .api.chunks import BULK_CODECS
from .api.servicer import KVKeeperServicer
from .config import Config, ConfigError
from .ids import CLUSTER
from .ledger import Ledger
from .ledger.sessions import tag
from .metrics import Metrics
from .ops import grpclog, logsetup
from .ops.gcpolicy import GcPolicy
from .ops.reload import plan_reload
from .ops.sdnotify import notify as sd_notify, start_progress
from .ops.socketpath import claim_socket_path
from .ops.startfaults import ADDRESS_ERRNOS, PATH_ERRNOS, SIZE_ERRNOS, blame, listen_failure
from .ops.startsignals import interruptible
from .ops.teardown import run_all, run_all_now, unlink_present
from .ops.traffic_file import open_traffic, reload_traffic
from .ops.watch import CounterWatch
from .peer.metrics import PeerCollector
from .peer.service import PeerService
from .security.access import give_group, resolve_group
from .security.auth import AuthInterceptor, AuthPolicy, check_exposure, server_credentials
from .security.revocation import log_revocations, plan_revocations
from .security.tokens import TokenTable, load_tokens
from .tiers.arena import Arena, ArenaSpaceError
from .tiers.configured import lower_tiers
from .tiers.disk_tier import DiskTier
from .version import package_version
from .tiers.stack import TierStack

log = logging.getLogger("kvkeeper")

SERVICE_NAME = kvkeeper_pb2.DESCRIPTOR.services_by_name["KVKeeper"].full_name
ADMIN_SERVICE_NAME = admin_pb2.DESCRIPTOR.services_by_name["KVKeeperAdmin"].full_name
RESIDENCY_SERVICE_NAME = residency_pb2.DESCRIPTOR.services_by_name["KVKeeperResidency"].full_name
REAP_INTERVAL_S = 1.0
# After the last call of a drain: time for a client to read the tail of its
# answer before the connection goes (api/drain.py). Within the grace period.
LINGER_SECONDS = 0.5


class Daemon:
    """One running kvkeeper: the grpc.aio server and what it serves."""

    def __init__(self, config: Config, interrupt: Optional[Callable[[], None]] = None) -> None:
        """`interrupt`: called during long start-up steps; what it raises ends start-up
        (ops/startsignals.py: a SIGTERM while the arena is prefaulted)."""
        self.config = config
        # grpc's ERROR for a call whose client just left is no daemon fault (ops/grpclog.py).
        grpclog.install()
        self.started_at = time.monotonic()
        # Everything that can refuse the configuration comes before any file is touched.
        self.tokens: Optional[TokenTable] = (load_tokens(config.auth.tokens_file)
                                             if config.auth.tokens_file else None)
        check_exposure(config, self.tokens)
        self._tcp_credentials = server_credentials(config)
        self._gid = resolve_group(config.listen.socket_group,
                                  config.source_of("listen.socket_group"))
        self.ledger = Ledger(config.to_ledger_config(),
                             quotas=self.tokens.quotas if self.tokens else None)
        self.traffic = open_traffic(config, self.ledger)   # [ledger] traffic_file: a bad path refuses
        ht = config.host_tier
        name = ht.name or f"kvkeeper-{os.getpid()}"
        if config.listen.socket:
            # Before the arena: a second daemon with the same config must fail
            # here, not after replacing the live daemon's arena file.
            claim_socket_path(os.path.abspath(config.listen.socket))
        t0 = time.perf_counter()
        path = os.path.join(ht.shm_dir, name)
        try:
            with blame(config, "host_tier.capacity_bytes", f"the arena {path} cannot be that large",
                       SIZE_ERRNOS), \
                    blame(config, "host_tier.shm_dir", f"cannot create the arena {path}",
                          PATH_ERRNOS, path=path):
                self.arena = Arena.create(path, ht.capacity_bytes, ht.page_bytes,
                                          prefault_pages=ht.prefault, progress=interruptible(
                                              start_progress("prefaulting the arena",
                                                             ht.capacity_bytes), interrupt))
        except ArenaSpaceError as e:
            raise ConfigError(e.strerror, key="host_tier.capacity_bytes",
                              source=config.source_of("host_tier.capacity_bytes")) from None
        if ht.prefault:
            log.info("host tier: %.2f GiB arena prefaulted in %.2fs (host_tier.prefault)",
                     ht.capacity_bytes / 2**30, time.perf_counter() - t0)
        # Whoever may use the socket may map the arena (same-host fast path).
        try:
            os.chmod(self.arena.path, config.listen.socket_mode & 0o660)
            give_group(self.arena.path, self._gid)
        except BaseException:
            self.arena.close()
            raise
        if self.arena.page_count < self.ledger.top.capacity_pages:
            raise RuntimeError("arena holds fewer pages than the ledger plans for")
        try:
            lower = lower_tiers(config, self.ledger)
        except BaseException:
            self.arena.close()
            raise
        self.stack = TierStack(self.ledger, self.arena, lower)
        self.metrics = Metrics()
        self.metrics.attach_ledger(self.ledger, self.started_at)
        self.metrics.attach_stack(self.stack)
        opts = [("grpc.max_send_message_length", config.server.max_message_bytes),
                ("grpc.max_receive_message_length", config.server.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        # The interceptor exists only with a tokens file: without one, no RPC pays for it.
        self.auth: Optional[AuthPolicy] = None
        interceptors = []
        if self.tokens is not None:
            self.auth = AuthPolicy(self.tokens, mutual_tls=bool(config.tls.client_ca_file),
                                   require_token_on_socket=config.auth.require_token_on_socket)
            interceptors.append(AuthInterceptor(self.auth))
        self.server = grpc.aio.server(options=opts, interceptors=interceptors)
        self.servicer = KVKeeperServicer(
            self.ledger, self.arena, self.metrics, version=package_version(), started_at=self.started_at,
            max_message_bytes=config.server.max_message_bytes, stack=self.stack)
        if self.auth is not None:
            self.servicer.authorize_namespace = self.auth.check_namespace
            self.servicer.may_see_model = self.auth.covers
        self.servicer.traffic = self.traffic.recorder
        add_guarded(kvkeeper_pb2_grpc.add_KVKeeperServicer_to_server, self.servicer, self.server,
                    codecs=BULK_CODECS)
        self.residency = ResidencyServicer(self.ledger, self.servicer)
        add_guarded(residency_pb2_grpc.add_KVKeeperResidencyServicer_to_server, self.residency,
                    self.server)
        services = [SERVICE_NAME, RESIDENCY_SERVICE_NAME]
        self.admin: Optional[AdminServicer] = None
        if config.admin.enabled:
            self.admin = AdminServicer(self.ledger, self.servicer, self.stack)
            add_guarded(admin_pb2_grpc.add_KVKeeperAdminServicer_to_server, self.admin, self.server)
            services.append(ADMIN_SERVICE_NAME)
        self.health = Health()
        # Generic handlers only, as add_guarded's (decoding.GenericOnly: per-call cost).
        health_pb2_grpc.add_HealthServicer_to_server(self.health, GenericOnly(self.server))
        reflection_pb2_grpc.add_ServerReflectionServicer_to_server(reflection.aio.ReflectionServicer(
            (*services, health.SERVICE_NAME, reflection.SERVICE_NAME)), GenericOnly(self.server))
        self.watch = CounterWatch(self.stack, storm_blocks=config.server.eviction_storm_blocks)
        self.port = 0
        self.socket_path: Optional[str] = None
        self._metrics_http: Any = None
        self._reaper: Optional[asyncio.Task[None]] = None
        self._gc_ticker: Optional[asyncio.Task[None]] = None
        self._stopped = False
        # grpc's server: None before start(), False while (or if never past) its start, True after.
        self._started: Optional[bool] = None
        # Same-host peer handles (KV cache memory as descriptors), beside the socket.
        self.peer: Optional[PeerService] = None
        # Match without gRPC, beside the socket (api/match_lane.py); none with tokens.
        self.lane: Optional[MatchLaneServer] = None
        self.gc = GcPolicy(config.server.gc_freeze_interval_seconds)

    @property
    def disk(self) -> Optional[DiskTier]:
        """The disk tier when one is configured (tests and tools reach its store here)."""
        return self.stack.tier(DiskTier.name)  # type: ignore[return-value]

    @property
    def cluster(self) -> Optional[Any]:
        """The cluster tier when one is configured (a cluster.tier.ClusterTier)."""
        return self.stack.tier(CLUSTER)

    def bind(self) -> int:
        lc = self.config.listen
        if self.config.metrics.address:
            # First: the socket's backlog accepts as soon as its port is added,
            # before start(), and whoever waits for it may scrape at once.
            with blame(self.config, "metrics.address", "cannot serve /metrics there",
                       ADDRESS_ERRNOS):
                self._metrics_http = self.metrics.start_http(self.config.metrics.address)
        if lc.socket:
            path = os.path.abspath(lc.socket)
            claim_socket_path(path)
            self.server.add_insecure_port(f"unix:{path}")
            self.socket_path = path
            self.peer = PeerService(self.ledger, peer_socket_path(path), lc.socket_mode,
                                    lambda p: give_group(p, self._gid))
            self.peer.bind()
            if self.tokens is None:
                self.lane = MatchLaneServer(self.servicer, lane_path(path), lc.socket_mode,
                                            lambda p: give_group(p, self._gid),
                                            self.config.server.max_message_bytes)
                self.lane.bind()
                self.metrics.registry.register(LaneCollector(self.lane))
            self.metrics.registry.register(PeerCollector(self.peer))
        if lc.tcp:
            try:
                if self._tcp_credentials is not None:
                    self.port = self.server.add_secure_port(lc.tcp, self._tcp_credentials)
                else:
                    self.port = self.server.add_insecure_port(lc.tcp)
            except RuntimeError:   # grpcio raises where older versions answered 0
                self.port = 0
            if self.port == 0:
                raise listen_failure(self.config, "listen.tcp", lc.tcp)
        return self.port

    def unbind(self) -> None:
        """Undo bind() and remove the arena: a daemon that never served (nothing to drain)."""
        m, lane, peer = self._metrics_http, self.lane, self.peer
        run_all_now([("closing the match lane", lambda: lane and lane.unbind()),
                     ("closing the peer socket", lambda: peer and peer.unbind()),
                     ("removing the socket", lambda: unlink_present(self.socket_path)),
                     ("closing /metrics", lambda: m and m.close()),
                     ("removing the arena", self.arena.close)])

    @property
    def metrics_address(self) -> str:
        """Where /metrics is served, with the port bound (metrics.address may say 0), or "off"."""
        m = self._metrics_http
        if m is None:
            return "off"
        return f"[{m.host}]:{m.port}" if ":" in m.host else f"{m.host}:{m.port}"

    async def start(self) -> None:
        self._started = False
        # Before the first request can arrive: the ledger and the disk tier's
        # recovered index are built, and nothing in flight gets frozen with them.
        settled = self.gc.settle(time.monotonic())
        if settled is not None:
            log.info("gc: %d objects frozen after start-up (collection and freeze took %.3fs)",
                     self.gc.frozen_objects, settled.seconds)
        await self.server.start()
        self._started = True
        if self.socket_path:
            os.chmod(self.socket_path, self.config.listen.socket_mode)
            give_group(self.socket_path, self._gid)
        if self.peer is not None:
            await self.peer.start()
        if self.lane is not None:
            await self.lane.start()
        self._reaper = asyncio.get_running_loop().create_task(self._reap())
        self._gc_ticker = asyncio.get_running_loop().create_task(self._gc_ticks())
        await self.health.set("", SERVING)
        await self.health.set(SERVICE_NAME, SERVING)
        log.info("kvkeeper %s serving: socket=%s tcp=%s metrics=%s arena=%s (%d pages of %d B) policy=%s "
                 "auth=%s admin=%s",
                 package_version(), self.socket_path, self.config.listen.tcp and f"port {self.port}",
                 self.metrics_address, self.arena.path, self.arena.page_count,
                 self.arena.page_bytes, self.ledger.config.policy, self._auth_summary(),
                 "on" if self.admin is not None else "off")
        sd_notify(f"READY=1\nSTATUS=serving socket={self.socket_path or '-'} "
                  f"tcp={self.config.listen.tcp and self.port or '-'}")

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            try:
                await self.stack.maintain()
                report = self.ledger.expire(time.monotonic())
                self.watch.tick(time.monotonic())
                self.traffic.tick(time.monotonic())
            except Exception:  # noqa: BLE001 - the reaper must outlive a bug report
                log.exception("expiry failed")
                continue
            for sid in report.sessions:
                log.info("session end %s reason=expired", tag(sid))
            if report.reservations:
                log.info("reclaimed %d reservations that were never committed", len(report.reservations))

    async def _gc_ticks(self) -> None:
        """GcPolicy's ticks on a timer of their own: the interval may be under a second."""
        while True:
            # At most REAP_INTERVAL_S: a reload may shorten the interval (tick() checks due()).
            await asyncio.sleep(min(self.gc.interval_s or REAP_INTERVAL_S, REAP_INTERVAL_S))
            try:
                self.gc.tick(time.monotonic())
            except Exception:  # noqa: BLE001 - as the reaper: outlive a bug report
                log.exception("gc tick failed")

    def _auth_summary(self) -> str:
        parts = []
        if self.tokens is not None:
            parts.append(f"{len(self.tokens.grants)} tokens")
        if self.config.tls.cert_file:
            parts.append("mutual TLS" if self.config.tls.client_ca_file else "TLS")
        return ", ".join(parts) or "none"

    def reload(self, new: Config) -> None:
        """Apply what may change while serving (see ops/reload.py); log what is refused."""
        plan = plan_reload(self.config, new)
        for key, why in plan.refused:
            log.error("reload: %s not changed: %s", key, why,
                      extra={"event": "reload_refused", "key": key})
        config = plan.config
        table = None
        if config.auth.tokens_file:
            # Re-read even when the path is unchanged: editing the file in place is the usual way.
            try:
                table = load_tokens(config.auth.tokens_file)
                check_exposure(config, table, running=self.tokens)
            except ConfigError as e:
                log.error("reload: auth.tokens_file not changed: %s", e,
                          extra={"event": "reload_refused", "key": "auth.tokens_file"})
                table = None
                config = replace(config, auth=self.config.auth)
                plan.applied = [k for k in plan.applied if k != "auth.tokens_file"]
        sc = config.server
        logsetup.set_level(sc.log_level)
        logsetup.set_format(sc.log_format)
        self.watch.storm.threshold = sc.eviction_storm_blocks
        self.gc.set_interval(sc.gc_freeze_interval_seconds, time.monotonic())
        if table is not None and self.auth is not None:
            revoked = plan_revocations(self.ledger.sessions.values(), table, self.tokens)
            self.tokens = self.auth.table = table
            self.ledger.quotas = dict(table.quotas)
            self.ledger.revoke(log_revocations(revoked))   # their calls now fail, not later
        self.traffic, config = reload_traffic(self.traffic, self.config, config, self.ledger, plan)
        self.servicer.traffic = self.traffic.recorder
        self.config = config
        log.info("reload: applied %s%s", ", ".join(plan.applied) or "no changed keys",
                 f"; tokens file re-read ({len(table.grants)} tokens, {len(table.quotas)} quotas)"
                 if table is not None else "",
                 extra={"event": "reload", "applied": plan.applied,
                        "refused": [k for k, _ in plan.refused]})

    async def stop(self, grace: Optional[float] = None, linger: float = 0.0) -> None:
        """Drain and release, within `grace` seconds. `linger`: how long the
        connections stay open after the last call ended (see api/drain.py);
        a daemon process lingers (serve()), one in a test process need not."""
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.server.grace_seconds if grace is None else grace
        calls = self.servicer.calls
        deadline = time.monotonic() + grace
        try:
            sd_notify(f"STOPPING=1\nSTATUS=draining (grace {grace:g}s)")
            # NOT_SERVING, and every health Watch ends with it (api/health.py).
            await self.health.enter_graceful_shutdown()
            self.servicer.serving = False
            # Watches never end by themselves: they would hold the whole grace period.
            self.servicer.watches.end_all()
            self.residency.end_all()
            for task in (self._reaper, self._gc_ticker):
                if task is not None:
                    task.cancel()
            if self._started:
                # Ours first: gRPC's own drain drops every connection as the last call ends.
                await calls.settle(deadline, linger)
                await self.server.stop(max(0.0, deadline - time.monotonic()))
            elif self._started is None:
                await self.server.stop(0)   # never started: only its listeners to close
            # else: stopped while grpc's start() ran (it raises then): the process ends it.
        finally:
            # Whatever happened above, nothing is left behind (ops/teardown.py).
            await run_all(self._releases())
        log.info("kvkeeper stopped")

    def _releases(self) -> list[tuple[str, Callable[[], Any]]]:
        steps: list[tuple[str, Callable[[], Any]]] = []
        if self.peer is not None:
            steps.append(("closing the peer socket", self.peer.stop))
        if self.lane is not None:
            steps.append(("closing the match lane", self.lane.stop))
        # No request comes any more: hand the heap back to CPython's own GC.
        steps.append(("releasing the GC policy", self.gc.release))
        steps.append(("writing the traffic file", self.traffic.close))
        # Write-back: everything acknowledged reaches the tiers below before the arena goes.
        steps.append(("closing the tiers", self.stack.close))
        # In-flight RPCs are done: nobody holds a view into the arena any more.
        steps.append(("removing the arena", self.arena.close))
        if self.socket_path:
            steps.append(("removing the socket", lambda: unlink_present(self.socket_path)))
        if self._metrics_http is not None:
            steps.append(("closing /metrics", self._metrics_http.close))
        return steps

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


def create_server(config: Config,
                  interrupt: Optional[Callable[[], None]] = None) -> tuple[Daemon, int]:
    """Build and bind a daemon; `await daemon.start()` serves. Returns (daemon, tcp port).
    `interrupt`: see Daemon."""
    daemon = Daemon(config, interrupt)
    try:
        port = daemon.bind()
    except BaseException:
        with contextlib.suppress(Exception):   # logged by its step; bind()'s error is raised
            daemon.unbind()
        raise
    return daemon, port
