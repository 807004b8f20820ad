"""kvkeeper.server.ops.sdnotify, and `kvkeeper serve` as a systemd Type=notify service:
READY=1 only once the socket accepts connections, STOPPING=1 on SIGTERM."""
from __future__ import annotations

import os
import socket
import subprocess
import tempfile
import time
import uuid
from pathlib import Path
from typing import Iterator

import grpc
import pytest
from deploy_support import clean_env, serve_args, socket_accepts, stop, wait_until
from grpc_health.v1 import health_pb2, health_pb2_grpc
from kvkeeper.server.ops import sdnotify


@pytest.fixture
def shortdir() -> Iterator[Path]:
    # AF_UNIX paths are limited to 108 bytes; pytest's tmp_path can be longer.
    d = tempfile.mkdtemp(prefix="kvkd-", dir="/tmp")
    try:
        yield Path(d)
    finally:
        for p in Path(d).iterdir():
            p.unlink()
        os.rmdir(d)


def listener(address: str) -> socket.socket:
    """A datagram socket standing in for systemd's notify socket at `address`
    (a path, or "@name" for the abstract namespace)."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    s.bind("\0" + address[1:] if address.startswith("@") else address)
    return s


def recv(s: socket.socket, timeout: float) -> str:
    s.settimeout(timeout)
    return s.recv(4096).decode()


# --------------------------------------------------------------------------- the module
def test_no_socket_is_a_no_op(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert sdnotify.notify("READY=1") is False
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": ""}) is False


def test_sends_to_a_path(shortdir: Path) -> None:
    path = str(shortdir / "notify")
    with listener(path) as s:
        assert sdnotify.notify("READY=1\nSTATUS=up", env={"NOTIFY_SOCKET": path}) is True
        assert recv(s, 2) == "READY=1\nSTATUS=up"


def test_sends_to_an_abstract_address() -> None:
    name = f"@kvkeeper-test-{uuid.uuid4().hex}"
    assert sdnotify.notify_address({"NOTIFY_SOCKET": name}) == "\0" + name[1:]
    with listener(name) as s:
        assert sdnotify.notify("STOPPING=1", env={"NOTIFY_SOCKET": name}) is True
        assert recv(s, 2) == "STOPPING=1"


def test_reads_the_environment(shortdir: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = str(shortdir / "notify")
    monkeypatch.setenv("NOTIFY_SOCKET", path)
    with listener(path) as s:
        assert sdnotify.notify("READY=1") is True
        assert recv(s, 2) == "READY=1"


@pytest.mark.parametrize("address", ["/nonexistent/kvkeeper/notify", "vsock:2:1234", "relative"])
def test_failure_is_reported_not_raised(address: str, caplog: pytest.LogCaptureFixture) -> None:
    assert sdnotify.notify("READY=1", env={"NOTIFY_SOCKET": address}) is False
    assert "sd_notify" in caplog.text


# --------------------------------------------------------------------------- the daemon
def health(sock: Path) -> str:
    with grpc.insecure_channel(f"unix://{sock}") as ch:
        resp = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(service=""),
                                                    timeout=5)
    return health_pb2.HealthCheckResponse.ServingStatus.Name(resp.status)


def test_a_long_start_up_step_extends_the_start_timeout() -> None:
    """Prefaulting a large arena takes ~0.4 s per GiB: every few seconds of
    it push systemd's TimeoutStartSec ahead and say how far it got."""
    now = [0.0]
    sent: list = []
    progress = sdnotify.start_progress("prefaulting the arena", 8 << 30, clock=lambda: now[0],
                                       send=lambda s: sent.append(s) or True)
    progress(1 << 30)
    assert sent == []                       # under START_NOTE_EVERY_S: nothing yet
    now[0] = sdnotify.START_NOTE_EVERY_S
    progress(2 << 30)
    now[0] += 1.0
    progress(3 << 30)
    assert sent == [f"EXTEND_TIMEOUT_USEC={int(sdnotify.START_EXTEND_S * 1e6)}\n"
                    "STATUS=prefaulting the arena: 2.0 of 8.0 GiB"]
    assert sdnotify.START_EXTEND_S > sdnotify.START_NOTE_EVERY_S


@pytest.mark.parametrize("kind", ["path", "abstract"])
def test_serve_notifies_ready_then_stopping(shortdir: Path, kind: str) -> None:
    address = (str(shortdir / "notify") if kind == "path"
               else f"@kvkeeper-test-{uuid.uuid4().hex}")
    sock = shortdir / "kvk.sock"
    with listener(address) as notify:
        notify.settimeout(0.05)
        proc = subprocess.Popen(serve_args(sock), stderr=subprocess.PIPE, text=True,
                                env=clean_env(NOTIFY_SOCKET=address))
        try:
            deadline = time.monotonic() + 30
            msg = None
            while msg is None:
                try:
                    msg = notify.recv(4096).decode()
                except TimeoutError:
                    if proc.poll() is not None:
                        raise AssertionError(f"daemon exited early: {proc.stderr.read()}")
                    if time.monotonic() > deadline:
                        raise AssertionError("no READY=1 within 30 s")
                    continue
            # The moment READY=1 is read, what it promises must hold already: no retry.
            accepting_at_ready = sock.exists() and socket_accepts(sock)
            lines = msg.split("\n")
            assert "READY=1" in lines, msg
            assert any(line.startswith("STATUS=serving") for line in lines), msg
            assert f"socket={sock}" in msg
            assert accepting_at_ready, "READY=1 arrived before the socket accepted connections"
            assert health(sock) == "SERVING"

            # Nothing else while it serves.
            notify.settimeout(0.3)
            with pytest.raises(socket.timeout):
                notify.recv(4096)

            rc, err = stop(proc)
            msg = recv(notify, 5)
            assert "STOPPING=1" in msg.split("\n"), msg
            assert "STATUS=draining" in msg
            assert rc == 0, err
            assert not sock.exists()
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.communicate()


def test_serve_without_notify_socket_still_serves(shortdir: Path) -> None:
    sock = shortdir / "kvk.sock"
    proc = subprocess.Popen(serve_args(sock), stderr=subprocess.PIPE, text=True, env=clean_env())
    try:
        wait_until(lambda: sock.exists() and socket_accepts(sock), 30, "the socket", proc)
        assert health(sock) == "SERVING"
    finally:
        rc, err = stop(proc)
    assert rc == 0, err
    assert "sd_notify" not in err
