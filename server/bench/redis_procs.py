"""redis-server processes on loopback for the cluster benchmark: one server, or a
Redis Cluster of three masters with one replica each.

The benchmark ships with the daemon, so it cannot use the test suite's
fixtures (tests/redis_servers.py); this module is the benchmark's own,
minimal launcher: no persistence (`save ""`, no AOF), loopback only, a
private directory per server, stopped with SIGTERM (SIGKILL after 10 s).
Valkey's `valkey-server` / `valkey-cli` are used where Redis's are absent.
"""
from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from typing import Optional, Sequence

from . import ports
from .servers import terminate

READY_TIMEOUT_S = 30.0
CLUSTER_BUS_OFFSET = 10000   # a cluster node also listens on port + 10000
CLUSTER_READY_TIMEOUT_S = 60.0
START_TRIES = 5              # a chosen port taken before the server bound it: choose again


class RedisUnavailable(RuntimeError):
    """No redis-server (or valkey-server) on PATH, or it would not start."""


def find_binary(names: Sequence[str]) -> Optional[str]:
    for n in names:
        path = shutil.which(n)
        if path:
            return path
    return None


def _binary(tool: str) -> str:
    """redis-<tool>, else valkey-<tool>, on PATH."""
    path = find_binary((f"redis-{tool}", f"valkey-{tool}"))
    if path is None:
        raise RedisUnavailable(f"neither redis-{tool} nor valkey-{tool} is on PATH "
                               "(Debian: apt-get install redis-server)")
    return path


def server_binary() -> str:
    return _binary("server")


def cli_binary() -> str:
    return _binary("cli")


def free_port(bus: bool = False) -> int:
    """A free loopback port outside the ephemeral range (ports.py says why); with
    `bus`, its cluster bus port (+10000) too."""
    try:
        return ports.free_port(CLUSTER_BUS_OFFSET if bus else 0)
    except ports.NoFreePort as e:
        raise RedisUnavailable(str(e)) from e


def _ping(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.5) as s:
            s.sendall(b"PING\r\n")
            return s.recv(64).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One redis-server on 127.0.0.1:<port>; `with RedisServer(...) as r: r.url`."""

    def __init__(self, maxmemory: int = 0, cluster: bool = False,
                 port: Optional[int] = None, workdir: Optional[str] = None) -> None:
        self.maxmemory = maxmemory
        self.cluster = cluster
        self.fixed_port = port is not None
        self.port = port or free_port(bus=cluster)
        self._own_dir = workdir is None
        self.dir = workdir or tempfile.mkdtemp(prefix="kvkredis-")
        self.proc: Optional[subprocess.Popen[bytes]] = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def args(self) -> list[str]:
        a = [server_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
             "--save", "", "--appendonly", "no", "--dir", self.dir, "--daemonize", "no",
             "--logfile", os.path.join(self.dir, "redis.log")]
        if self.maxmemory:
            a += ["--maxmemory", str(self.maxmemory), "--maxmemory-policy", "allkeys-lru"]
        if self.cluster:
            a += ["--cluster-enabled", "yes", "--cluster-node-timeout", "2000",
                  "--cluster-config-file", os.path.join(self.dir, "nodes.conf")]
        return a

    def start(self) -> "RedisServer":
        os.makedirs(self.dir, exist_ok=True)
        for attempt in range(START_TRIES):
            err = self._launch()
            if err is None:
                return self
            lost_port = "Address already in use" in err and not self.fixed_port
            if not lost_port or attempt == START_TRIES - 1:
                self.stop()
                raise RedisUnavailable(f"redis-server on port {self.port} did not start: {err}")
            self.port = free_port(bus=self.cluster)
        raise AssertionError("unreachable")

    def _launch(self) -> Optional[str]:
        """Start the process; None once it answers PING, else why not (it is stopped)."""
        # Its log goes to the logfile in self.dir (read back when it fails to start).
        log = os.path.join(self.dir, "redis.log")
        if os.path.exists(log):
            os.unlink(log)
        self.proc = subprocess.Popen(self.args(), stdin=subprocess.DEVNULL,
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + READY_TIMEOUT_S
        while not _ping(self.port):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                err = self._log_tail()
                proc, self.proc = self.proc, None
                terminate(proc)
                return err or "(no log)"
            time.sleep(0.05)
        return None

    def _log_tail(self) -> str:
        log = os.path.join(self.dir, "redis.log")
        try:
            with open(log) as f:
                return f.read()[-1000:]
        except OSError:
            return ""

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is not None:
            terminate(proc)
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "RedisServer":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class RedisClusterProcs:
    """Three masters and three replicas on loopback, joined by `redis-cli --cluster create`."""

    def __init__(self, maxmemory: int = 0, masters: int = 3, replicas: int = 1) -> None:
        self.base = tempfile.mkdtemp(prefix="kvkrcluster-")
        n = masters * (1 + replicas)
        self.replicas = replicas
        self.nodes = [RedisServer(maxmemory, cluster=True,
                                  workdir=os.path.join(self.base, str(i))) for i in range(n)]

    @property
    def url(self) -> str:
        return "redis+cluster://" + ",".join(n.address for n in self.nodes)

    @property
    def startup_nodes(self) -> list[tuple[str, int]]:
        return [("127.0.0.1", n.port) for n in self.nodes]

    def start(self) -> "RedisClusterProcs":
        try:
            for n in self.nodes:
                n.start()
            r = subprocess.run([cli_binary(), "--cluster", "create",
                                *(n.address for n in self.nodes),
                                "--cluster-replicas", str(self.replicas), "--cluster-yes"],
                               capture_output=True, text=True, timeout=60)
            if r.returncode != 0:
                raise RedisUnavailable(f"redis-cli --cluster create failed: {r.stdout[-500:]}"
                                       f"{r.stderr[-500:]}")
            self._wait_ok()
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ok(self) -> None:
        """Until every node says cluster_state:ok and every replica's link to its
        master is up: a node still turning into a replica drops its clients."""
        deadline = time.monotonic() + CLUSTER_READY_TIMEOUT_S
        cli = cli_binary()

        def ask(n: RedisServer, *args: str) -> str:
            return subprocess.run([cli, "-p", str(n.port), *args], capture_output=True,
                                  text=True, timeout=10).stdout

        while True:
            states = [ask(n, "cluster", "info") for n in self.nodes]
            roles = [ask(n, "info", "replication") for n in self.nodes]
            replicas = [r for r in roles if "role:slave" in r]
            if (all("cluster_state:ok" in s for s in states)
                    and len(replicas) == len(self.nodes) - len(self.nodes) // (1 + self.replicas)
                    and all("master_link_status:up" in r for r in replicas)):
                return
            if time.monotonic() > deadline:
                raise RedisUnavailable("the Redis Cluster did not reach cluster_state:ok "
                                       "with every replica in sync")
            time.sleep(0.2)

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()
        shutil.rmtree(self.base, ignore_errors=True)

    def __enter__(self) -> "RedisClusterProcs":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


__all__ = ["RedisClusterProcs", "RedisServer", "RedisUnavailable", "cli_binary",
           "free_port", "server_binary"]
