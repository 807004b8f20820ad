"""kvkeeper.server.ops.process: `kvkeeper serve` as a process. A signal during
start-up stops it cleanly (exit 0, nothing left behind) or reloads once it
serves; a start-up mistake of the configuration exits 2 with its key, no
traceback; a reload that fails in any way is logged as reload_refused."""
from __future__ import annotations

import logging
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from kvkeeper.server.config import ConfigError
from kvkeeper.server.ops.process import reload_config

# Start-up held at a known step while a marker file exists (the test removes it
# after its signal), so that the signal lands during start-up whatever the
# machine's speed.
_HELD = """
import os, sys, time
from kvkeeper.server import app
marker, where = sys.argv[1], sys.argv[2]

def hold():
    open(marker, "w").close()
    deadline = time.monotonic() + 30
    while os.path.exists(marker) and time.monotonic() < deadline:
        time.sleep(0.01)
        yield

if where == "prefault":          # inside the arena's prefault (its progress callback)
    real = app.Arena.create
    def create(path, size, page, prefault_pages=False, progress=None):
        def slow(done):
            for _ in hold():
                progress(done)
        return real(path, size, page, prefault_pages=True, progress=slow)
    app.Arena.create = create
else:                            # after the arena, while the listeners are bound
    real_bind = app.Daemon.bind
    def bind(self):
        port = real_bind(self)
        for _ in hold():
            pass
        return port
    app.Daemon.bind = bind
from kvkeeper.server.cli import main
sys.exit(main(sys.argv[3:]))
"""


def _serve(tmp: Path, where: str, sig: int) -> subprocess.Popen:
    """A daemon held during start-up (`where`) until it got `sig`."""
    marker = tmp / "held"
    args = ["serve", "--config", str(tmp / "kv.toml")]
    (tmp / "kv.toml").write_text(
        f'[listen]\nsocket = "{tmp}/kv.sock"\ntcp = ""\n[metrics]\naddress = ""\n'
        f'[host_tier]\ncapacity_bytes = "8MiB"\nshm_dir = "{tmp}"\nname = "arena"\n')
    proc = subprocess.Popen([sys.executable, "-c", _HELD, str(marker), where, *args],
                            stderr=subprocess.PIPE, text=True, cwd=tmp,
                            env={**os.environ, "KVKEEPER_CONFIG": ""})
    deadline = time.monotonic() + 30
    while not marker.exists():
        assert proc.poll() is None, proc.communicate()[1]
        assert time.monotonic() < deadline, "start-up never reached the held step"
        time.sleep(0.01)
    proc.send_signal(sig)
    marker.unlink()
    return proc


def _end(proc: subprocess.Popen) -> str:
    try:
        return proc.communicate(timeout=30)[1]
    except subprocess.TimeoutExpired:
        proc.kill()
        return proc.communicate()[1]


@pytest.mark.parametrize("where, sig", [("prefault", signal.SIGTERM), ("bind", signal.SIGINT)])
def test_a_stop_signal_during_start_up_stops_cleanly(tmp_path: Path, where: str, sig: int) -> None:
    proc = _serve(tmp_path, where, sig)
    err = _end(proc)
    assert proc.returncode == 0, err
    assert f"{signal.Signals(sig).name} during start-up" in err and "Traceback" not in err
    assert sorted(os.listdir(tmp_path)) == ["kv.toml"], err   # arena and sockets gone


def test_sighup_during_start_up_reloads_once_serving(tmp_path: Path) -> None:
    proc = _serve(tmp_path, "prefault", signal.SIGHUP)
    deadline = time.monotonic() + 30
    while not (tmp_path / "kv.sock").exists() and time.monotonic() < deadline:
        assert proc.poll() is None, _end(proc)
        time.sleep(0.02)
    time.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    err = _end(proc)
    assert proc.returncode == 0, err
    assert err.count("SIGHUP: re-reading the configuration") == 1, err
    assert err.index("serving:") < err.index("draining")
    assert sorted(os.listdir(tmp_path)) == ["kv.toml"], err


def test_a_start_up_mistake_exits_2_naming_the_key(tmp_path: Path) -> None:
    r = subprocess.run([sys.executable, "-m", "kvkeeper.server.cli", "serve", "--socket",
                        str(tmp_path / "kv.sock"), "--tcp", "", "--metrics", "",
                        "--set", "host_tier.shm_dir=/nonexistent-kvk/shm"],
                       capture_output=True, text=True, cwd=tmp_path, timeout=60,
                       env={**os.environ, "KVKEEPER_CONFIG": ""})
    assert r.returncode == 2, r.stderr
    assert "config error: host_tier.shm_dir = '/nonexistent-kvk/shm'" in r.stderr
    assert "Traceback" not in r.stderr
    assert os.listdir(tmp_path) == []


def test_a_taken_listen_port_exits_2_naming_the_key_and_leaves_no_socket(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        tcp = f"127.0.0.1:{taken.getsockname()[1]}"
        r = subprocess.run([sys.executable, "-m", "kvkeeper.server.cli", "serve", "--socket",
                            str(tmp_path / "kv.sock"), "--tcp", tcp, "--metrics", "",
                            "--set", "host_tier.prefault=false"],
                           capture_output=True, text=True, cwd=tmp_path, timeout=60,
                           env={**os.environ, "KVKEEPER_CONFIG": ""})
    assert r.returncode == 2, r.stderr
    assert f"config error: listen.tcp = '{tcp}' (from flag --tcp): cannot listen there" in r.stderr
    assert "Traceback" not in r.stderr
    # The unix socket, the peer socket and the match lane were bound first.
    assert os.listdir(tmp_path) == [], r.stderr


class _Untouched:
    def reload(self, new: Any) -> None:
        raise AssertionError("a config that was not read reached the daemon")


def _refusals(caplog: Any) -> list[logging.LogRecord]:
    return [r for r in caplog.records if getattr(r, "event", "") == "reload_refused"]


@pytest.mark.parametrize("error, key", [
    (ConfigError("config file kv.toml: not UTF-8", source="config file kv.toml"), ""),
    (ConfigError("bad level", key="server.log_level"), "server.log_level"),
    (UnicodeDecodeError("utf-8", b"\xff", 0, 1, "invalid start byte"), ""),
    (RuntimeError("a bug in the loader"), ""),
])
def test_a_reload_whose_config_cannot_be_read_is_refused(caplog, error, key) -> None:
    def loader() -> Any:
        raise error

    with caplog.at_level(logging.INFO, logger="kvkeeper"):
        reload_config(_Untouched(), loader)   # type: ignore[arg-type]
    (refused,) = _refusals(caplog)
    assert refused.levelno == logging.ERROR and refused.key == key
    assert str(error) in refused.getMessage()


def test_a_reload_that_fails_while_applied_is_refused(caplog) -> None:
    class Failing:
        def reload(self, new: Any) -> None:
            raise ValueError("cannot apply")

    with caplog.at_level(logging.INFO, logger="kvkeeper"):
        reload_config(Failing(), lambda: object())   # type: ignore[arg-type]
    (refused,) = _refusals(caplog)
    assert "cannot apply" in refused.getMessage() and refused.exc_info is not None
