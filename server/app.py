"""Daemon assembly: ledger + arena + servicer + health + reflection + metrics.

Shape after grpc's own examples: `create_server(config)` returns
`(server, port)` with the TCP port actually bound (tests ask for port 0).
Shutdown order: health NOT_SERVING, refuse new RPCs, let in-flight ones
finish within the grace period, then release the tiers.
"""
from __future__ import annotations

import asyncio
import logging
import os
import signal
import socket
import stat
import time
from typing import Any, Optional

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from kvkeeper.v1 import kvkeeper_pb2, kvkeeper_pb2_grpc

from .api.servicer import KVKeeperServicer
from .config import Config
from .ledger import Ledger
from .metrics import Metrics
from .sdnotify import notify as sd_notify
from .tiers.arena import Arena
from .tiers.disk_tier import DiskTier

log = logging.getLogger("kvkeeper")

SERVICE_NAME = kvkeeper_pb2.DESCRIPTOR.services_by_name["KVKeeper"].full_name
REAP_INTERVAL_S = 1.0


def version() -> str:
    try:
        from importlib.metadata import version as _v
        return _v("kvkeeper")
    except Exception:  # noqa: BLE001 - running from a source tree
        return "0+unknown"


def _claim_socket_path(path: str) -> None:
    """Remove a stale socket left by a dead daemon; refuse to steal a live one."""
    if not os.path.lexists(path):
        return
    if not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise RuntimeError(f"{path} exists and is not a socket; remove it or choose another --socket")
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        probe.connect(path)
    except (ConnectionRefusedError, FileNotFoundError):
        os.unlink(path)
        return
    finally:
        probe.close()
    raise RuntimeError(f"another daemon is listening on {path}; stop it or choose another --socket")


class Daemon:
    """One running kvkeeper: the grpc.aio server and what it serves."""

    def __init__(self, config: Config) -> None:
        self.config = config
        self.started_at = time.monotonic()
        self.ledger = Ledger(config.to_ledger_config())
        ht = config.host_tier
        name = ht.name or f"kvkeeper-{os.getpid()}"
        if config.listen.socket:
            # Before the arena: a second daemon with the same config must fail
            # here, not after replacing the live daemon's arena file.
            _claim_socket_path(os.path.abspath(config.listen.socket))
        self.arena = Arena.create(os.path.join(ht.shm_dir, name), ht.capacity_bytes, ht.page_bytes)
        # Whoever may use the socket may map the arena (same-host fast path).
        os.chmod(self.arena.path, config.listen.socket_mode & 0o660)
        if self.arena.page_count < self.ledger.top.capacity_pages:
            raise RuntimeError("arena holds fewer pages than the ledger plans for")
        self.metrics = Metrics()
        self.metrics.attach_ledger(self.ledger, self.started_at)
        self.disk: Optional[DiskTier] = None
        dt = config.disk_tier
        if dt.path:
            try:
                self.disk = DiskTier.open(
                    self.ledger, self.arena, path=dt.path, capacity_bytes=dt.capacity_bytes,
                    write_policy=dt.write_policy, admit_after_hits=dt.admit_after_hits,
                    owner_id=dt.owner_id)
            except BaseException:
                self.arena.close()
                raise
            self.metrics.attach_disk(self.disk)
        opts = [("grpc.max_send_message_length", config.server.max_message_bytes),
                ("grpc.max_receive_message_length", config.server.max_message_bytes),
                ("grpc.so_reuseport", 0)]
        self.server = grpc.aio.server(options=opts)
        self.servicer = KVKeeperServicer(
            self.ledger, self.arena, self.metrics, version=version(), started_at=self.started_at,
            max_message_bytes=config.server.max_message_bytes, disk=self.disk)
        kvkeeper_pb2_grpc.add_KVKeeperServicer_to_server(self.servicer, self.server)
        self.health = health.aio.HealthServicer()
        health_pb2_grpc.add_HealthServicer_to_server(self.health, self.server)
        reflection.enable_server_reflection(
            (SERVICE_NAME, health.SERVICE_NAME, reflection.SERVICE_NAME), self.server)
        self.port = 0
        self.socket_path: Optional[str] = None
        self._metrics_http: Any = None
        self._reaper: Optional[asyncio.Task[None]] = None
        self._stopped = False

    def bind(self) -> int:
        lc = self.config.listen
        if lc.socket:
            path = os.path.abspath(lc.socket)
            _claim_socket_path(path)
            self.server.add_insecure_port(f"unix:{path}")
            self.socket_path = path
        if lc.tcp:
            self.port = self.server.add_insecure_port(lc.tcp)
            if self.port == 0:
                raise RuntimeError(f"could not listen on {lc.tcp}")
        return self.port

    async def start(self) -> None:
        await self.server.start()
        if self.socket_path:
            os.chmod(self.socket_path, self.config.listen.socket_mode)
        if self.config.metrics.address:
            self._metrics_http = self.metrics.start_http(self.config.metrics.address)
        self._reaper = asyncio.get_running_loop().create_task(self._reap())
        await self.health.set("", health_pb2.HealthCheckResponse.SERVING)
        await self.health.set(SERVICE_NAME, health_pb2.HealthCheckResponse.SERVING)
        log.info("kvkeeper %s serving: socket=%s tcp=%s metrics=%s arena=%s (%d pages of %d B) policy=%s",
                 version(), self.socket_path, self.config.listen.tcp and f"port {self.port}",
                 self.config.metrics.address or "off", self.arena.path, self.arena.page_count,
                 self.arena.page_bytes, self.ledger.config.policy)
        sd_notify(f"READY=1\nSTATUS=serving socket={self.socket_path or '-'} "
                  f"tcp={self.config.listen.tcp and self.port or '-'}")

    async def _reap(self) -> None:
        while True:
            await asyncio.sleep(REAP_INTERVAL_S)
            try:
                if self.disk is not None:
                    self.disk.keep_alive()
                    await self.disk.maintain()
                report = self.ledger.expire(time.monotonic())
            except Exception:  # noqa: BLE001 - the reaper must outlive a bug report
                log.exception("expiry failed")
                continue
            for sid in report.sessions:
                log.info("session end id=%s reason=expired", sid)
            if report.reservations:
                log.info("reclaimed %d reservations that were never committed", len(report.reservations))

    async def stop(self, grace: Optional[float] = None) -> None:
        if self._stopped:
            return
        self._stopped = True
        grace = self.config.server.grace_seconds if grace is None else grace
        sd_notify(f"STOPPING=1\nSTATUS=draining (grace {grace:g}s)")
        await self.health.enter_graceful_shutdown()
        self.servicer.serving = False
        if self._reaper:
            self._reaper.cancel()
        await self.server.stop(grace)
        if self.disk is not None:
            # Write-back: everything acknowledged reaches the disk before the arena goes.
            await self.disk.close()
        # In-flight RPCs are done: nobody holds a view into the arena any more.
        self.arena.close()
        if self.socket_path and os.path.lexists(self.socket_path):
            os.unlink(self.socket_path)
        if self._metrics_http is not None:
            self._metrics_http.close()
        log.info("kvkeeper stopped")

    async def wait_for_termination(self) -> None:
        await self.server.wait_for_termination()


def create_server(config: Config) -> tuple[Daemon, int]:
    """Build and bind a daemon; `await daemon.start()` serves. Returns (daemon, tcp port)."""
    daemon = Daemon(config)
    try:
        port = daemon.bind()
    except BaseException:
        daemon.arena.close()
        raise
    return daemon, port


async def serve(config: Config) -> None:
    daemon, _ = create_server(config)
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    try:
        await daemon.start()
        await stop.wait()
        log.info("signal received: draining (grace %.1fs)", config.server.grace_seconds)
    finally:
        await daemon.stop()


def _runner() -> Any:
    """uvloop's runner when installed (faster RPC turnaround), asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def run(config: Config) -> int:
    logging.basicConfig(level=config.server.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        _runner()(serve(config))
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    return 0
