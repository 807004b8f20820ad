"""The cluster benchmark's redis-server launcher: a start that chooses its
port again when the port was taken between choosing and binding."""
from __future__ import annotations

import shutil
import socket

import pytest

from kvkeeper.server.bench.redis_procs import RedisServer, RedisUnavailable, free_port

needs_redis = pytest.mark.skipif(
    not (shutil.which("redis-server") or shutil.which("valkey-server")),
    reason="redis-server not installed (tests/run.sh installs Debian's redis-server)")


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
