"""A `kvkeeper serve` subprocess whose stderr (the log) is read line by line as it comes."""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any, Callable, Optional
from kvkeeper.server.bench.ports import free_port

KVKEEPER = [sys.executable, "-m", "kvkeeper.server.cli"]
WAIT_S = 30.0


class DaemonProcess:
    def __init__(self, config: Path, cwd: Path) -> None:
        self.lines: list[str] = []
        self._q: "queue.Queue[Optional[str]]" = queue.Queue()
        self.proc = subprocess.Popen(KVKEEPER + ["serve", "--config", str(config)], cwd=cwd,
                                     stderr=subprocess.PIPE, text=True,
                                     env={**os.environ, "KVKEEPER_CONFIG": ""})
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.proc.stderr is not None
        for line in self.proc.stderr:
            self._q.put(line.rstrip("\n"))
        self._q.put(None)

    def wait_for(self, pred: Callable[[dict], bool], what: str) -> dict:
        """The next JSON log line that satisfies `pred` (lines before it are kept in .lines)."""
        deadline = time.monotonic() + WAIT_S
        while True:
            try:
                line = self._q.get(timeout=max(0.0, deadline - time.monotonic()))
            except queue.Empty:
                raise AssertionError(f"no log line {what} within {WAIT_S}s:\n" +
                                     "\n".join(self.lines[-30:])) from None
            if line is None:
                raise AssertionError(f"the daemon exited before {what}:\n" +
                                     "\n".join(self.lines[-30:]))
            self.lines.append(line)
            try:
                record = json.loads(line)
            except ValueError:
                continue
            if pred(record):
                return record

    def event(self, name: str) -> dict:
        return self.wait_for(lambda r: r.get("event") == name, f"with event={name}")

    def serving(self) -> dict:
        return self.wait_for(lambda r: "serving" in r.get("msg", ""), "saying serving")

    def hup(self) -> None:
        self.proc.send_signal(signal.SIGHUP)

    def stop(self) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
        try:
            rc = self.proc.wait(timeout=WAIT_S)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            rc = self.proc.wait()
        while True:  # the rest of the log
            try:
                line = self._q.get(timeout=WAIT_S)
            except queue.Empty:
                break
            if line is None:
                break
            self.lines.append(line)
        return rc

    @property
    def log(self) -> str:
        return "\n".join(self.lines)


def write_config(path: Path, *, sock: str, port: int, name: str, tokens: str,
                 capacity: str = "1MiB", log_level: str = "info") -> None:
    path.write_text(f"""
[listen]
socket = "{sock}"
tcp = "127.0.0.1:{port}"
[metrics]
address = ""
[host_tier]
capacity_bytes = "{capacity}"
page_bytes = "4KiB"
name = "{name}"
[server]
log_level = "{log_level}"
log_format = "json"
grace_seconds = 1
[auth]
tokens_file = "{tokens}"
""")


def tokens_text(**tokens: Any) -> str:
    """[tokens.NAME] tables: NAME=(token, [models]) or (token, [models], admin)."""
    out = []
    for name, spec in tokens.items():
        token, models, *admin = spec
        out.append(f'[tokens.{name}]\ntoken = "{token}"\nmodels = {json.dumps(models)}\n'
                   f'admin = {"true" if admin and admin[0] else "false"}\n')
    return "\n".join(out)


def two_tenants_and_ops(token_a: str, token_b: str, token_ops: str) -> str:
    """The tokens file of the isolation suites: tenant-a (model-a), tenant-b
    (model-b) and an admin, ops, for every model."""
    return tokens_text(**{"tenant-a": (token_a, ["model-a"]), "tenant-b": (token_b, ["model-b"]),
                          "ops": (token_ops, ["*"], True)})


def write_tokens(directory: Path, text: str) -> str:
    """tokens.toml in `directory`, readable by its owner only (as the daemon wants)."""
    p = directory / "tokens.toml"
    p.write_text(text)
    p.chmod(0o600)
    return str(p)
