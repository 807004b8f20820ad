"""`kvkeeper serve` as a real process: defaults, readiness, SIGTERM draining."""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc
from kvkeeper.server.bench.ports import free_port

KVKEEPER = [sys.executable, "-m", "kvkeeper.server.cli"]


def port_free(port: int) -> bool:
    with socket.socket() as s:
        # As the daemon binds: a port in TIME_WAIT from an earlier run is free.
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
        return True


def wait_for(path: Path, proc: subprocess.Popen, timeout: float = 20.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if proc.poll() is not None:
            raise AssertionError(f"daemon exited early: {proc.stderr.read() if proc.stderr else ''}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{path} did not appear")
        time.sleep(0.05)
    time.sleep(0.2)


def stop(proc: subprocess.Popen, *, signalled: bool = False) -> str:
    if not signalled and proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
    try:
        _, err = proc.communicate(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        _, err = proc.communicate()
    return err or ""


def test_serve_with_defaults(tmp_path: Path) -> None:
    if not (port_free(50051) and port_free(9464)):
        pytest.skip("default ports 50051/9464 are taken on this machine")
    proc = subprocess.Popen(KVKEEPER + ["serve"], cwd=tmp_path, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "KVKEEPER_CONFIG": ""})
    try:
        wait_for(tmp_path / "kvkeeper.sock", proc)
        body = urllib.request.urlopen("http://127.0.0.1:9464/metrics", timeout=5).read().decode()
        assert 'kvkeeper_tier_capacity_bytes{tier="host"}' in body
        arena = Path(f"/dev/shm/kvkeeper-{proc.pid}")
        assert arena.stat().st_size == 1 << 30
        out = subprocess.run(KVKEEPER + ["status", "--url", "127.0.0.1:50051", "--json"],
                             capture_output=True, text=True, timeout=30)
        assert out.returncode == 0, out.stderr
        status = json.loads(out.stdout)
        assert status["health"] == "SERVING"
    finally:
        err = stop(proc)
    assert proc.returncode == 0, err
    assert not (tmp_path / "kvkeeper.sock").exists()
    assert not Path(f"/dev/shm/kvkeeper-{proc.pid}").exists()


def test_config_error_exits_nonzero(tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text('[host_tier]\ncapacity_bytes = "12QB"\n')
    out = subprocess.run(KVKEEPER + ["serve", "--config", str(bad)], capture_output=True, text=True,
                         timeout=30)
    assert out.returncode == 2
    assert "host_tier.capacity_bytes" in out.stderr and "QB" in out.stderr


def test_sigterm_drains_in_flight_rpcs(tmp_path: Path) -> None:
    sock = tmp_path / "k.sock"
    signalled = False
    proc = subprocess.Popen(
        KVKEEPER + ["serve", "--socket", str(sock), "--tcp", "", "--metrics", "",
                    "--capacity", "80MiB", "--page-size", "1MiB", "--set", "server.grace_seconds=10"],
        cwd=tmp_path, stderr=subprocess.PIPE, text=True)
    try:
        wait_for(sock, proc)
        with grpc.insecure_channel(f"unix:{sock}", options=[
                ("grpc.max_receive_message_length", 64 << 20)]) as ch:
            stub = pb_grpc.KVKeeperStub(ch)
            health = __import__("grpc_health.v1.health_pb2_grpc", fromlist=["x"])
            hstub = health.HealthStub(ch)
            from grpc_health.v1 import health_pb2
            assert hstub.Check(health_pb2.HealthCheckRequest()).status == health_pb2.HealthCheckResponse.SERVING
            sid = stub.RegisterSession(pb.RegisterSessionRequest(namespace=pb.NamespaceDescriptor(
                model_id="m", block_tokens=32, block_bytes=1 << 20))).session_id
            keys = [i.to_bytes(32, "little") for i in range(48)]
            r = stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=keys,
                                                       transport=pb.TRANSPORT_STREAM))
            stub.WriteBlocks(iter([pb.WriteChunk(session_id=sid, reservation_id=r.reservation_id,
                                                 index=i, offset=0, data=bytes([i]) * (1 << 20))
                                   for i in range(48)]))
            stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=r.reservation_id))
            m = stub.Match(pb.MatchRequest(session_id=sid, keys=keys, lease=True))
            stream = stub.LoadStream(pb.LoadRequest(session_id=sid, lease_id=m.lease_id))
            first = next(stream)
            assert first.index == 0
            proc.send_signal(signal.SIGTERM)
            signalled = True
            time.sleep(0.5)
            # New calls are refused while the stream in flight completes.
            with pytest.raises(grpc.RpcError) as refused:
                stub.Match(pb.MatchRequest(session_id=sid, keys=keys[:1]), timeout=5)
            assert refused.value.code() == grpc.StatusCode.UNAVAILABLE
            rest = list(stream)
            got = [first] + rest
            assert sorted({c.index for c in got}) == list(range(48))
            assert all(c.data == bytes([c.index]) * len(c.data) for c in got)
            assert sum(len(c.data) for c in got) == 48 << 20
    finally:
        err = stop(proc, signalled=signalled)
    assert proc.returncode == 0, err
    assert "draining" in err
    assert not sock.exists()
    assert not any(p.name == f"kvkeeper-{proc.pid}" for p in Path("/dev/shm").iterdir())
