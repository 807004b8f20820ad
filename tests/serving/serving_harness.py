"""A real OpenAI-compatible `vllm serve` (through vllm_serve.py) as a restartable process.

Everything needed to (re)start the server lives in a state directory
(`server.json`: argv, env, working directory, URL, log; `server.pid`), so a restart works the
same from the test process and from a shell command that another program
runs between its phases:

    python tests/serving/serving_harness.py restart STATE_DIR

stops the running server (SIGTERM to its process group, SIGKILL after a
grace period), starts a new one with the same arguments and returns once
`/health` answers 200. `restart_cmd(state_dir)` gives that line, for the
`--restart-cmd` of `kvkeeper experiment prefix` and `kvkeeper verify replay`.

This module imports neither vLLM nor kvkeeper: the restart command stays cheap.
"""
from __future__ import annotations

import json
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any, Dict, List, Optional, Tuple
from kvkeeper.server.bench.ports import free_port

HERE = Path(__file__).resolve().parent
VLLM_SERVE = HERE / "vllm_serve.py"
SPEC = "server.json"
PIDFILE = "server.pid"
START_TIMEOUT_S = 600.0   # a 2-core machine under load; an idle one takes ~30 s
STOP_GRACE_S = 30.0
# The README's URL of the quick start's daemon (its default socket, ./kvkeeper.sock),
# relative to the server's working directory.
README_DAEMON_URL = "unix://./kvkeeper.sock"
# The README's connector: (kv_connector, kv_connector_module_path).
CONNECTOR = ("KVKeeperConnector", "kvkeeper.connector")


def kv_transfer_config(daemon_url: str, connector: Tuple[str, str] = CONNECTOR,
                       **extra: Any) -> Dict[str, Any]:
    """The `--kv-transfer-config` of the README's vLLM example, for `daemon_url`
    (`connector`: another class and module, e.g. the benchmarks' timed subclass)."""
    return {"kv_connector": connector[0], "kv_connector_module_path": connector[1],
            "kv_role": "kv_both",
            "kv_connector_extra_config": {"kvkeeper_url": daemon_url, **extra}}


def serve_argv(model: str, port: int, daemon_url: str, block_size: int = 32,
               max_model_len: int = 2048, connector: Tuple[str, str] = CONNECTOR,
               **extra: Any) -> List[str]:
    """`vllm serve` of the tiny model on 127.0.0.1:port with prefix caching and the
    connector; `extra`: more kv_connector_extra_config."""
    return [sys.executable, str(VLLM_SERVE), "serve", model, "--host", "127.0.0.1",
            "--port", str(port), "--block-size", str(block_size), "--max-model-len",
            str(max_model_len), "--dtype", "float32", "--enforce-eager", "--seed", "0",
            "--enable-prefix-caching",
            # As the README recommends: the engine gets 2 s to shut down before the
            # front end SIGKILLs it, so the connector's sessions close at once
            # (vLLM's default 0 makes that a race the serving tests would lose under load).
            "--shutdown-timeout", "2", "--kv-transfer-config",
            json.dumps(kv_transfer_config(daemon_url, connector, **extra))]


def serve_env(base: Optional[Dict[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")   # GiB; the tiny model needs little
    # As in `kvkeeper bench ttft`: with a KV connector, vLLM's CPU worker keeps one core for
    # the engine core and one for the connector; on 2 cores that leaves none, and it falls
    # back to every core. One reserved core keeps compute on the other.
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    return env


class Server:
    """The server described by STATE_DIR/server.json; at most one process at a time."""

    def __init__(self, state_dir: str) -> None:
        self.state_dir = Path(state_dir)
        spec = json.loads((self.state_dir / SPEC).read_text())
        self.argv: List[str] = spec["argv"]
        self.env: Dict[str, str] = spec["env"]
        self.url: str = spec["url"]
        self.cwd: str = spec["cwd"]
        self.log_path = Path(spec["log"])
        self._child: Optional[subprocess.Popen] = None  # when started by this process

    @classmethod
    def create(cls, state_dir: str, argv: List[str], env: Dict[str, str], url: str,
               cwd: str) -> "Server":
        d = Path(state_dir)
        d.mkdir(parents=True, exist_ok=True)
        (d / SPEC).write_text(json.dumps({"argv": argv, "env": env, "url": url, "cwd": cwd,
                                          "log": str(d / "vllm.log")}, indent=1))
        return cls(state_dir)

    @property
    def pid(self) -> Optional[int]:
        try:
            return int((self.state_dir / PIDFILE).read_text())
        except (FileNotFoundError, ValueError):
            return None

    def start(self, timeout: float = START_TIMEOUT_S) -> None:
        if self.pid is not None and group_alive(self.pid):
            raise RuntimeError(f"a server (pid {self.pid}) is already running for {self.state_dir}")
        with open(self.log_path, "a") as log:
            log.write(f"\n===== start {time.strftime('%H:%M:%S')}: {shlex.join(self.argv)}\n")
            log.flush()
            # Its own session and process group: a stop reaches vLLM's engine core too.
            self._child = subprocess.Popen(self.argv, env=self.env, cwd=self.cwd, stdout=log,
                                           stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                           start_new_session=True)
        (self.state_dir / PIDFILE).write_text(str(self._child.pid))
        self.wait_healthy(timeout)

    def wait_healthy(self, timeout: float = START_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while True:
            pid = self.pid
            if pid is None or not group_alive(pid):
                raise RuntimeError(f"vllm serve exited while starting; log tail:\n{self.log_tail()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=5) as r:
                    if r.status == 200:
                        return
            except (urllib.error.URLError, OSError):
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"vllm serve not healthy in {timeout:.0f} s; log tail:\n"
                                   f"{self.log_tail()}")
            time.sleep(0.5)

    def stop(self) -> None:
        pid = self.pid
        if pid is None:
            return
        for sig, wait in ((signal.SIGTERM, STOP_GRACE_S), (signal.SIGKILL, 10.0)):
            try:
                os.killpg(pid, sig)
            except ProcessLookupError:
                break
            deadline = time.monotonic() + wait
            while group_alive(pid) and time.monotonic() < deadline:
                self._reap()
                time.sleep(0.1)
            if not group_alive(pid):
                break
        self._reap()
        if group_alive(pid):
            raise RuntimeError(f"process group {pid} survived SIGKILL")
        (self.state_dir / PIDFILE).unlink(missing_ok=True)

    def restart(self, timeout: float = START_TIMEOUT_S) -> None:
        self.stop()
        self.start(timeout)

    def _reap(self) -> None:
        if self._child is not None:
            self._child.poll()

    def log_tail(self, n: int = 4000) -> str:
        try:
            return self.log_path.read_text(errors="replace")[-n:]
        except FileNotFoundError:
            return "(no log)"


def group_alive(pgid: int) -> bool:
    """Any live (non-zombie) process in process group pgid. Read from /proc
    rather than kill(0), which also succeeds for zombies nobody has reaped
    (the server's parent may be gone, and PID 1 here need not reap)."""
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            text = stat.read_text()
        except OSError:
            continue
        # pid (comm) state ppid pgrp ...; comm may hold spaces and parentheses
        fields = text[text.rfind(")") + 2:].split()
        if len(fields) > 2 and int(fields[2]) == pgid and fields[0] not in ("Z", "X"):
            return True
    return False


def restart_cmd(state_dir: str) -> str:
    """The shell command that restarts the server of state_dir and waits until it is healthy."""
    return shlex.join([sys.executable, str(Path(__file__).resolve()), "restart", str(state_dir)])


def main(argv: List[str]) -> int:
    if len(argv) != 2 or argv[0] not in ("restart", "stop", "start"):
        print("usage: serving_harness.py {restart|stop|start} STATE_DIR", file=sys.stderr)
        return 2
    server = Server(argv[1])
    t0 = time.monotonic()
    getattr(server, argv[0])()
    print(f"{argv[0]}: {server.url} (pid {server.pid}) in {time.monotonic() - t0:.1f} s",
          file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
