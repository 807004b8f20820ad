"""An engine's connector presents a bearer token (kvkeeper_token_file) to a
daemon with auth.tokens_file, over TCP: with it the engine registers and looks
up; without it every call is refused, and vLLM still gets its answers."""
from __future__ import annotations

import socket
import time
from typing import Any

import pytest
from test_connector_guard import fake_vllm_config, request, vllm_only

from connector_harness import DaemonProcess, short_tmpdir

TOKEN = "engine-fleet-0123456789abcdef"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture
def daemon(tmp_path: Any) -> Any:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens.fleet]\ntoken = "{TOKEN}"\nmodels = ["*"]\n')
    tokens.chmod(0o600)
    d = DaemonProcess(f"{short_tmpdir()}/kvk.sock", capacity="16MiB", page="32KiB",
                      tcp=f"127.0.0.1:{free_port()}",
                      extra_args=["--set", f"auth.tokens_file={tokens}"]).start()
    yield d
    d.cleanup()


def sessions_after(d: DaemonProcess, connector: Any, timeout: float) -> int:
    """Look up a prompt until the daemon holds a session, or `timeout` passes."""
    deadline = time.monotonic() + timeout
    while True:
        # None: the lookup is still on its way (asked again next step); never a hit here
        assert connector.get_num_new_matched_tokens(request(list(range(100))), 0)[0] in (0, None)
        n = d.stats().sessions
        if n or time.monotonic() > deadline:
            return n
        time.sleep(0.1)


@vllm_only
def test_an_engine_with_the_token_registers_and_one_without_is_refused(
        daemon: DaemonProcess, tmp_path: Any) -> None:
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorRole

    from kvkeeper.connector import KVKeeperConnector

    url = daemon.tcp
    # Without a token: refused (UNAUTHENTICATED), a miss for vLLM, no session.
    vc, kvc = fake_vllm_config({"kvkeeper_url": url})
    without = KVKeeperConnector(vc, KVConnectorRole.SCHEDULER, kvc)
    try:
        assert sessions_after(daemon, without, 1.5) == 0
    finally:
        without.shutdown()
    token_file = tmp_path / "token"
    token_file.write_text(TOKEN + "\n")
    vc, kvc = fake_vllm_config({"kvkeeper_url": url, "kvkeeper_token_file": str(token_file)})
    with_token = KVKeeperConnector(vc, KVConnectorRole.SCHEDULER, kvc)
    try:
        assert sessions_after(daemon, with_token, 10.0) >= 1
    finally:
        with_token.shutdown()
