"""Restarting the server under test between runs, or waiting for its operator to.

`--restart-cmd CMD` runs CMD through the shell; it must return once the old
server is stopped (a new one may still be starting: e.g. `systemctl restart
vllm`, or a script that kills the server and starts it again in the
background). Then the server is polled until /health or /v1/models answers.
"""
from __future__ import annotations

import subprocess
import sys
import time
from typing import Any, Dict, Optional, TextIO

from .openai_client import Backend, BackendError


class RestartError(RuntimeError):
    """The restart command failed, or the server did not come back."""


def restart(backend: Backend, cmd: str, timeout: float, ready_timeout: float,
            log: Optional[TextIO] = None) -> Dict[str, Any]:
    """Run cmd, then wait until the backend answers; what happened, for the result."""
    log = log or sys.stderr
    print(f"restart: {cmd}", file=log, flush=True)
    t0 = time.monotonic()
    try:
        # Its output goes to our stderr, not into a pipe: a server it starts in the
        # background would hold a pipe open, and reading it would never end.
        proc = subprocess.run(cmd, shell=True, timeout=timeout, stdin=subprocess.DEVNULL,
                              stdout=2, stderr=2)
    except subprocess.TimeoutExpired:
        raise RestartError(f"--restart-cmd did not finish within {timeout:g}s: {cmd}") from None
    if proc.returncode != 0:
        raise RestartError(f"--restart-cmd exited with status {proc.returncode}: {cmd}")
    ran = time.monotonic() - t0
    try:
        ready = backend.wait_ready(ready_timeout)
    except BackendError as e:
        raise RestartError(f"after --restart-cmd: {e}") from None
    return {"mode": "command", "cmd": cmd, "cmd_seconds": round(ran, 3),
            "ready_after_seconds": round(ready, 3)}


def operator_restart(backend: Backend, wait_seconds: Optional[float], ready_timeout: float,
                     stdin: Optional[TextIO] = None, log: Optional[TextIO] = None
                     ) -> Dict[str, Any]:
    """Ask the operator to restart the server: wait wait_seconds, or for Enter on
    stdin; then wait until the backend answers."""
    stdin, log = stdin or sys.stdin, log or sys.stderr
    if wait_seconds is not None:
        print(f"restart the server at {backend.base_url} now; waiting {wait_seconds:g}s",
              file=log, flush=True)
        time.sleep(wait_seconds)
        mode = "wait"
    else:
        print(f"restart the server at {backend.base_url}, then press Enter", file=log, flush=True)
        if not stdin.readline():
            raise RestartError("stdin closed before the operator confirmed the restart "
                               "(use --restart-cmd or --wait-seconds when not interactive)")
        mode = "operator"
    try:
        ready = backend.wait_ready(ready_timeout)
    except BackendError as e:
        raise RestartError(f"after the restart: {e}") from None
    return {"mode": mode, "wait_seconds": wait_seconds, "ready_after_seconds": round(ready, 3)}
