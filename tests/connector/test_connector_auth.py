"""An engine's connector presents a bearer token (kvkeeper_token_file) to a
daemon with auth.tokens_file, over TCP: with it the engine registers and looks
up; without it every call is refused, and vLLM still gets its answers."""
from __future__ import annotations

import time
from typing import Any

import pytest
from test_connector_guard import fake_vllm_config, request, vllm_only

from connector_harness import DaemonProcess, short_tmpdir
from kvkeeper.server.bench.ports import free_port

TOKEN = "engine-fleet-0123456789abcdef"


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


def test_a_refused_first_connect_backs_off_past_the_transport_probe(daemon: DaemonProcess) -> None:
    """A wrong token is refused at RegisterSession: the link asks again on the
    refusal's schedule (1 s doubling), not every 0.1-0.5 s as for a daemon
    that is down."""
    from kvkeeper.client import Client
    from kvkeeper.connector.link import DaemonLink, LinkDown

    tries = []

    def connect(*a: Any, **kw: Any) -> Any:
        tries.append(time.monotonic())
        return Client.connect(*a, **kw)

    link = DaemonLink(daemon.tcp, {"model_id": "m", "block_tokens": 32, "block_bytes": 4096},
                      instance_id="t", timeout=2.0, token="not-a-token-0123456789",
                      connect=connect)
    try:
        deadline = time.monotonic() + 2.5
        while time.monotonic() < deadline:
            with pytest.raises(LinkDown):
                link.call(lambda c: c.match([bytes(32)]), "match")
            time.sleep(0.02)
        # 0, then 1 s later (then 2 s later): at most 3 in 2.5 s, not 6 or more.
        assert 1 <= len(tries) <= 3, [round(t - tries[0], 2) for t in tries]
    finally:
        link.close()


def test_a_refused_client_makes_no_match_rpc_until_its_backoff_passes(tmp_path: Any) -> None:
    """The blocking client's leased Match (the connector's lookup) after a reload
    took the model from its token: refused without a Match RPC per call."""
    import signal
    import urllib.request

    from kvkeeper.client import Client, PermissionDeniedError

    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens.fleet]\ntoken = "{TOKEN}"\nmodels = ["m"]\n')
    tokens.chmod(0o600)
    metrics = f"127.0.0.1:{free_port()}"
    d = DaemonProcess(f"{short_tmpdir()}/kvk.sock", capacity="16MiB", page="32KiB",
                      tcp=f"127.0.0.1:{free_port()}", metrics=metrics,
                      extra_args=["--set", f"auth.tokens_file={tokens}"]).start()

    def matches() -> float:
        text = urllib.request.urlopen(f"http://{metrics}/metrics", timeout=5).read().decode()
        return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                   if line.startswith("kvkeeper_rpc_duration_seconds_count{")
                   and 'method="Match"' in line)
    try:
        c = Client.connect(d.tcp, {"model_id": "m", "block_tokens": 32, "block_bytes": 4096},
                           token=TOKEN, timeout=2.0, match_lane=False)
        try:
            c.match([bytes(32)], lease=True)
            tokens.write_text(f'[tokens.fleet]\ntoken = "{TOKEN}"\nmodels = ["other"]\n')
            assert d.proc is not None
            d.proc.send_signal(signal.SIGHUP)
            deadline = time.monotonic() + 10
            while d.stats().sessions:          # the reload ended the session
                assert time.monotonic() < deadline, "the reload did not revoke the session"
                time.sleep(0.05)
            with pytest.raises(PermissionDeniedError):
                c.match([bytes(32)], lease=True)     # registers again: refused
            before = matches()
            for _ in range(30):
                with pytest.raises(PermissionDeniedError):
                    c.match([bytes(32)], lease=True)
            assert matches() - before <= 1, "a Match RPC per refused call"
        finally:
            c.close()
    finally:
        d.cleanup()
