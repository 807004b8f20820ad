"""Start and stop the benchmark's server processes (serve_helper.py)."""
from __future__ import annotations

import os
import select
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from typing import Optional

READY_TIMEOUT_S = 60.0


def terminate(proc: "subprocess.Popen[bytes]", timeout: float = 10.0) -> None:
    """SIGTERM a child and reap it; SIGKILL if it has not exited after `timeout`."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class ServerProcess:
    """A serve_helper child: `with ServerProcess.raw(...) as s: s.url`."""

    def __init__(self, args: list[str], socket_path: str, label: str) -> None:
        self.args = args
        self.socket_path = socket_path
        self.label = label
        self.proc: Optional[subprocess.Popen[bytes]] = None

    @property
    def url(self) -> str:
        return f"unix://{self.socket_path}"

    @property
    def target(self) -> str:
        """The grpc channel target."""
        return f"unix:{self.socket_path}"

    @classmethod
    def raw(cls, sockdir: str, buffer_bytes: int = 64 << 20) -> "ServerProcess":
        sock = os.path.join(sockdir, "raw.sock")
        return cls(["raw", "--socket", sock, "--buffer-bytes", str(buffer_bytes)], sock, "raw grpc")

    @classmethod
    def kvkeeper(cls, sockdir: str, capacity: int, page_bytes: int,
                 tcp: str = "", policy: str = "") -> "ServerProcess":
        """tcp: also listen on this "host:port" (the remote path's transport);
        policy: the ledger's eviction policy (default: the daemon's default)."""
        sock = os.path.join(sockdir, "kvk.sock")
        name = f"kvkeeper-bench-{uuid.uuid4().hex[:12]}"
        extra = (["--tcp", tcp] if tcp else []) + (["--eviction-policy", policy] if policy else [])
        return cls(["kvkeeper", "--socket", sock, "--capacity", str(capacity),
                    "--page-bytes", str(page_bytes), "--name", name, *extra], sock,
                   "kvkeeper daemon")

    def start(self) -> "ServerProcess":
        cmd = [sys.executable, "-m", "kvkeeper.server.bench.serve_helper", *self.args]
        # stdin stays open: the child stops when it closes (we exit or crash).
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE)
        assert self.proc.stdout is not None
        deadline = time.monotonic() + READY_TIMEOUT_S
        line = b""
        fd = self.proc.stdout.fileno()
        while not line.endswith(b"\n"):
            left = deadline - time.monotonic()
            if left <= 0 or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError(f"{self.label} did not start ({' '.join(cmd)})")
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 64)
                if not chunk:
                    continue
                line += chunk
        if line.strip() != b"READY":
            self.stop()
            raise RuntimeError(f"{self.label} said {line!r} instead of READY")
        return self

    def stop(self) -> None:
        proc, self.proc = self.proc, None
        if proc is None:
            return
        terminate(proc)
        for f in (proc.stdin, proc.stdout):
            try:
                if f is not None:
                    f.close()
            except OSError:
                pass

    def __enter__(self) -> "ServerProcess":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


class SocketDir:
    """A short temporary directory for unix sockets (paths are limited to 108 bytes)."""

    def __enter__(self) -> str:
        self.path = tempfile.mkdtemp(prefix="kvkb-", dir="/tmp")
        return self.path

    def __exit__(self, *exc: object) -> None:
        shutil.rmtree(self.path, ignore_errors=True)
