"""Real Redis (or Valkey) servers for tests: one server, and a Redis Cluster of
three masters with one replica each, on free loopback ports in temp dirs.

Each server runs in the foreground as a child of the test process, without
persistence, and is stopped (then killed) at teardown. Tests use them through
module-scoped fixtures (tests/server/tiers/cluster/conftest.py), so a test
file pays the cluster's start once. Without the binaries, `needs_redis` skips.
"""
from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator, Optional, Sequence

import pytest

from kvkeeper.server.bench import ports, redis_procs

SERVER = shutil.which("valkey-server") or shutil.which("redis-server")
CLI = shutil.which("valkey-cli") or shutil.which("redis-cli")
HAVE_REDIS = SERVER is not None and CLI is not None
NO_REDIS = "redis-server/redis-cli not installed (tests/run.sh installs Debian's redis-server)"
needs_redis = pytest.mark.skipif(not HAVE_REDIS, reason=NO_REDIS)
WAIT_S = 30.0
NODE_TIMEOUT_MS = 1000   # how soon a cluster declares a master failed


def free_port() -> int:
    """Free now, and outside the ephemeral range, so no outgoing connection takes
    it as its source port before a server binds it (ports.py says more)."""
    return ports.free_port()


class RedisServer:
    """One redis-server process on 127.0.0.1:`port`."""

    def __init__(self, root: Path, args: Sequence[str] = (), password: Optional[str] = None,
                 tls_dir: Optional[Path] = None) -> None:
        self.password = password
        self.tls_dir = tls_dir
        self.args = list(args)
        self.proc: Optional[subprocess.Popen[bytes]] = None
        # A chosen port taken before the server bound it: choose again, as the
        # benchmark's launcher does.
        tries = redis_procs.START_TRIES
        for attempt in range(tries):
            self.port = free_port()
            self.dir = root / f"redis-{self.port}"
            self.dir.mkdir(parents=True)
            try:
                self.start()
                return
            except AssertionError:
                self.stop()
                if "Address already in use" not in self.log() or attempt == tries - 1:
                    raise

    def start(self) -> None:
        assert SERVER is not None
        port_args = ["--port", str(self.port)]
        if self.tls_dir is not None:
            d = self.tls_dir
            port_args = ["--port", "0", "--tls-port", str(self.port),
                         "--tls-cert-file", str(d / "server.pem"),
                         "--tls-key-file", str(d / "server.key"),
                         "--tls-ca-cert-file", str(d / "ca.pem"), "--tls-auth-clients", "no",
                         # A cluster's bus and its replication run over TLS too
                         # (ignored by a server without cluster mode).
                         "--tls-cluster", "yes", "--tls-replication", "yes"]
        auth = ["--requirepass", self.password] if self.password else []
        self.proc = subprocess.Popen(
            [SERVER, *port_args, "--bind", "127.0.0.1", "--dir", str(self.dir), "--save", "",
             "--appendonly", "no", "--daemonize", "no", "--protected-mode", "no",
             "--logfile", str(self.dir / "redis.log"), *auth, *self.args],
            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        self.wait_ready()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    def cli(self, *args: str, check: bool = True) -> str:
        """redis-cli against this server (over TLS for a TLS server); its stdout."""
        assert CLI is not None
        r = subprocess.run([CLI, "-h", "127.0.0.1", "-p", str(self.port), *self.cli_flags(), *args],
                           capture_output=True, text=True, timeout=WAIT_S)
        if check and r.returncode != 0:
            raise AssertionError(f"redis-cli {' '.join(args)}: {r.stderr or r.stdout}")
        return r.stdout.strip()

    def cli_flags(self) -> list[str]:
        """redis-cli's flags for this server's password and TLS."""
        auth = ["--no-auth-warning", "-a", self.password] if self.password else []
        tls = ["--tls", "--cacert", str(self.tls_dir / "ca.pem")] if self.tls_dir else []
        return auth + tls

    def wait_ready(self) -> None:
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            assert self.proc is not None
            if self.proc.poll() is not None:
                raise AssertionError(f"redis-server on {self.port} exited:\n{self.log()}")
            if self._answers():
                return
            time.sleep(0.05)
        raise AssertionError(f"redis-server on {self.port} not ready in {WAIT_S}s:\n{self.log()}")

    def _answers(self) -> bool:
        if self.tls_dir is not None:   # redis-cli may lack TLS: a TCP connect will do
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=0.5).close()
                return True
            except OSError:
                return False
        return self.cli("PING", check=False) == "PONG"

    def log(self) -> str:
        try:
            return (self.dir / "redis.log").read_text()[-3000:]
        except OSError:
            return "(no log)"

    def kill(self) -> None:
        """SIGKILL: a node that dies without a word."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait()

    def limit_memory(self, nbytes: int, policy: str) -> None:
        """CONFIG SET maxmemory and maxmemory-policy (0: no limit)."""
        self.cli("CONFIG", "SET", "maxmemory-policy", policy)
        self.cli("CONFIG", "SET", "maxmemory", str(nbytes))

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)   # a paused server must hear SIGTERM
            self.proc.terminate()
            try:
                self.proc.wait(timeout=10)
            except subprocess.TimeoutExpired:
                self.kill()

    @property
    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None


class RedisCluster:
    """A Redis Cluster of three masters with one replica each; with `tls_dir`
    (server.pem, server.key, ca.pem) clients, the cluster bus and replication
    all speak TLS."""

    def __init__(self, root: Path, masters: int = 3, tls_dir: Optional[Path] = None) -> None:
        self.nodes: list[RedisServer] = []
        self.tls = tls_dir is not None
        try:
            for _ in range(masters * 2):
                self.nodes.append(RedisServer(root, [
                    "--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(NODE_TIMEOUT_MS),
                    # A replica takes over however long ago it last heard its master.
                    "--cluster-replica-validity-factor", "0",
                    "--cluster-port", str(free_port())], tls_dir=tls_dir))
            assert CLI is not None
            r = subprocess.run([CLI, *self.nodes[0].cli_flags(), "--cluster", "create",
                                *(n.address for n in self.nodes),
                                "--cluster-replicas", "1", "--cluster-yes"],
                               capture_output=True, text=True, timeout=WAIT_S)
            if r.returncode != 0:
                raise AssertionError(f"redis-cli --cluster create failed:\n{r.stdout}\n{r.stderr}")
            self.wait_ok()
        except BaseException:
            self.stop()
            raise

    @property
    def url(self) -> str:
        scheme = "rediss+cluster://" if self.tls else "redis+cluster://"
        return scheme + ",".join(n.address for n in self.nodes if n.alive)

    def alive_nodes(self) -> list[RedisServer]:
        return [n for n in self.nodes if n.alive]

    def masters(self) -> list[RedisServer]:
        return [n for n in self.alive_nodes() if "role:master" in n.cli("INFO", "replication")]

    def master_of(self, key: bytes) -> RedisServer:
        """The live master serving the slot of `key`."""
        slot = int(self.alive_nodes()[0].cli("CLUSTER", "KEYSLOT", key.decode()))
        for n in self.masters():
            me = next(line for line in n.cli("CLUSTER", "NODES").splitlines() if "myself" in line)
            for part in me.split()[8:]:   # the slot ranges this master serves
                lo, _, hi = part.partition("-")
                if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                    return n
        raise AssertionError(f"no live master serves slot {slot}")

    def wait_ok(self) -> None:
        """Until every live node says cluster_state:ok, sees three masters with
        slots, and every master has a replica in sync."""
        deadline = time.monotonic() + WAIT_S
        last = ""
        while time.monotonic() < deadline:
            try:
                states = [n.cli("CLUSTER", "INFO") for n in self.alive_nodes()]
                if all("cluster_state:ok" in s for s in states):
                    masters = self.masters()
                    synced = all("connected_slaves:1" in m.cli("INFO", "replication")
                                 for m in masters)
                    if len(masters) == len(self.nodes) // 2 and synced:
                        return
                last = states[0] if states else ""
            except AssertionError as e:
                last = str(e)
            time.sleep(0.1)
        raise AssertionError(f"the cluster is not ok after {WAIT_S}s: {last}")

    def wait_state_ok(self) -> None:
        """Until every live node says cluster_state:ok (after a failover)."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if all("cluster_state:ok" in n.cli("CLUSTER", "INFO", check=False)
                   for n in self.alive_nodes()):
                return
            time.sleep(0.1)
        raise AssertionError(f"the cluster did not recover in {WAIT_S}s")

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()


def one_node_cluster(root: Path, password: Optional[str] = None) -> RedisServer:
    """A Redis Cluster of one master holding every slot (quick; for start-up checks)."""
    srv = RedisServer(root, ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                             "--cluster-port", str(free_port())], password=password)
    srv.cli("CLUSTER", "ADDSLOTSRANGE", "0", "16383")
    deadline = time.monotonic() + WAIT_S
    while "cluster_state:ok" not in srv.cli("CLUSTER", "INFO"):
        assert time.monotonic() < deadline, "a one-node cluster did not come up"
        time.sleep(0.05)
    return srv


def temp_root() -> Path:
    return Path(tempfile.mkdtemp(prefix="kvk-redis-", dir=os.environ.get("TMPDIR", "/tmp")))


def remove(root: Path) -> None:
    shutil.rmtree(root, ignore_errors=True)


# ---------------------------------------------------------------- fixtures
# Module-scoped: import them into a conftest.py (`from redis_servers import
# redis_server, redis_cluster`) and a test file starts each at most once.

def _serving(make: "Callable[[Path], Any]") -> "Iterator[Any]":
    if not HAVE_REDIS:
        pytest.skip(NO_REDIS)
    root = temp_root()
    started = make(root)
    try:
        yield started
    finally:
        started.stop()
        remove(root)


@pytest.fixture(scope="module")
def redis_server() -> "Iterator[RedisServer]":
    """One server the test file shares (flush it, or use key prefixes of your own)."""
    yield from _serving(RedisServer)


@pytest.fixture(scope="module")
def redis_cluster() -> "Iterator[RedisCluster]":
    """Three masters with a replica each, shared by the test file: a test that
    kills a node restarts it (RedisServer.start) and waits (wait_ok)."""
    yield from _serving(RedisCluster)


@pytest.fixture
def own_server() -> "Iterator[RedisServer]":
    """A server of the test's own, to stop, pause or reconfigure."""
    yield from _serving(RedisServer)
