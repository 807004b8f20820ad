"""The cluster benchmark's redis-server launcher: ports outside the kernel's
ephemeral range (so no outgoing connection takes one before the server binds
it), and a start that chooses again when its port was taken anyway."""
from __future__ import annotations

import shutil
import socket

import pytest

from kvkeeper.server.bench import redis_procs
from kvkeeper.server.bench.redis_procs import (
    CLUSTER_BUS_OFFSET, RedisServer, RedisUnavailable, ephemeral_range, free_port)

needs_redis = pytest.mark.skipif(
    not (shutil.which("redis-server") or shutil.which("valkey-server")),
    reason="redis-server not installed (tests/run.sh installs Debian's redis-server)")


def test_ports_lie_outside_the_ephemeral_range_with_their_bus_port() -> None:
    lo, hi = ephemeral_range()
    assert lo <= hi
    for _ in range(50):
        p = free_port()
        assert not lo <= p <= hi and p >= redis_procs.PORT_FLOOR
        b = free_port(bus=True)
        assert not lo <= b <= hi and not lo <= b + CLUSTER_BUS_OFFSET <= hi
        assert b + CLUSTER_BUS_OFFSET <= 65535


def test_no_port_left_is_a_clear_error(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_procs, "ephemeral_range", lambda: (1, 65535))
    with pytest.raises(RedisUnavailable, match="outside the ephemeral range 1-65535"):
        free_port()


@needs_redis
def test_a_port_taken_before_the_server_binds_it_is_chosen_again() -> None:
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", free_port()))
    squatter.listen()
    taken = squatter.getsockname()[1]
    srv = RedisServer()
    srv.port = taken   # as if its choice was taken between choosing and binding
    try:
        with srv:
            assert srv.port != taken and srv.proc is not None and srv.proc.poll() is None
    finally:
        squatter.close()


@needs_redis
def test_a_port_given_by_the_caller_is_not_changed() -> None:
    with socket.socket() as squatter:
        squatter.bind(("127.0.0.1", free_port()))
        squatter.listen()
        taken = squatter.getsockname()[1]
        with pytest.raises(RedisUnavailable, match=f"(?s)port {taken} did not start.*in use"):
            RedisServer(port=taken).start()
