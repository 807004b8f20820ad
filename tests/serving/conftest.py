"""The `serving` fixture: a kvkeeper daemon and a real `vllm serve` with KVKeeperConnector on it.

One per test session (vLLM takes 20-40 s to start on a 2-core CPU): the
daemon is a `kvkeeper serve` subprocess on a unix socket in a temporary
directory, with its /metrics on a free loopback port; the server is the
OpenAI-compatible `vllm serve` of the tiny Llama (seeded random weights and a
512-token BPE tokenizer, tests/connector/tiny_llama.py) on another free port,
prefix caching on, started through vllm_serve.py so it runs on the CPU build.
As in the README, the daemon's socket is `kvkeeper.sock` in the server's
working directory and the connector names it `unix://./kvkeeper.sock`.
`serving.restart()` runs the shell command `serving.restart_cmd`, which
restarts the server and keeps the daemon, so a new vLLM process must load
from it.
Set KVKEEPER_TEST_KEEP_LOGS=1 to keep the directory with the logs.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import pytest

# The daemon process and the model come from the connector tests' helpers.
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "connector"))

from connector_harness import DaemonProcess, short_tmpdir, vllm_unavailable  # noqa: E402
from serving_harness import (README_DAEMON_URL, Server, free_port, restart_cmd,  # noqa: E402
                             serve_argv, serve_env)

MODEL_NAME = "tiny-llama"


@dataclass
class Serving:
    url: str                 # the OpenAI-compatible server: URL/v1/completions, URL/metrics
    model: str               # the served model name
    metrics_url: str         # the daemon's /metrics
    daemon_url: str          # the daemon (absolute; the server names it relative to its cwd)
    restart_cmd: str         # shell command: restart the server, return once healthy
    server: Server
    daemon: DaemonProcess
    tmp: str

    @property
    def server_metrics_url(self) -> str:
        return self.url + "/metrics"

    def restart(self) -> None:
        subprocess.run(self.restart_cmd, shell=True, check=True, timeout=900)


@pytest.fixture(scope="session")
def serving() -> Iterator[Serving]:
    why = vllm_unavailable()
    if why is not None:
        pytest.skip(why)
    from tiny_llama import write_tiny_llama

    tmp = short_tmpdir()
    model = f"{tmp}/model"
    write_tiny_llama(model, tokenizer=True)
    metrics_addr = f"127.0.0.1:{free_port()}"
    daemon = DaemonProcess(f"{tmp}/kvkeeper.sock", capacity="128MiB", page="32KiB",
                           log_path=f"{tmp}/daemon.log", metrics=metrics_addr)
    server = None
    try:
        daemon.start()
        port = free_port()
        argv = serve_argv(model, port, README_DAEMON_URL) + ["--served-model-name", MODEL_NAME]
        server = Server.create(f"{tmp}/server", argv, serve_env(), f"http://127.0.0.1:{port}",
                               cwd=tmp)
        server.start()
        yield Serving(url=server.url, model=MODEL_NAME, metrics_url=f"http://{metrics_addr}/metrics",
                      daemon_url=daemon.url, restart_cmd=restart_cmd(f"{tmp}/server"),
                      server=server, daemon=daemon, tmp=tmp)
    finally:
        try:
            if server is not None:
                server.stop()
        finally:
            daemon.cleanup()
            if not os.environ.get("KVKEEPER_TEST_KEEP_LOGS"):
                shutil.rmtree(tmp, ignore_errors=True)
            else:
                print(f"\nserving logs kept in {tmp}")
