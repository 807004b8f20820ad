"""kvkeeper.server.app: what the daemon leaves behind when stop() meets a failure or
a start that never finished, the start-up mistakes it reports as ConfigError
naming the key, the GC ticker after a reload, and the start-up line's metrics port."""
from __future__ import annotations

import asyncio
import logging
import os
import socket
import time
from dataclasses import replace
from typing import Any

import pytest

from kvkeeper.server.app import create_server
from kvkeeper.server.config import ConfigError


def _left(d: Any) -> list[str]:
    paths = [d.arena.path, d.socket_path, d.socket_path + ".peer", d.socket_path + ".match"]
    return [p for p in paths if os.path.lexists(p)]


async def test_stop_releases_everything_even_when_a_step_fails(daemon_config) -> None:
    d, _ = create_server(daemon_config())
    await d.start()
    assert len(_left(d)) == 4          # the arena, the socket, the peer and lane sockets

    async def broken(grace: Any = None) -> None:
        raise RuntimeError("grpc refused to stop")

    real, d.server.stop = d.server.stop, broken
    with pytest.raises(RuntimeError, match="grpc refused"):
        await d.stop(0)
    assert _left(d) == []
    await real(0)


async def test_a_failed_write_back_still_removes_the_arena_and_fails_the_stop(daemon_config) -> None:
    d, _ = create_server(daemon_config())
    await d.start()
    real = d.stack.close

    async def failing() -> None:
        await real()
        raise OSError("disk gone")

    d.stack.close = failing
    with pytest.raises(OSError, match="disk gone"):
        await d.stop(0)
    assert _left(d) == []


async def test_stop_while_start_was_cancelled_midway_cleans_up(daemon_config) -> None:
    """asyncio's runner on SIGINT cancels whatever runs: here, grpc's start()."""
    d, _ = create_server(daemon_config())
    start = asyncio.get_running_loop().create_task(d.start())
    await asyncio.sleep(0)
    start.cancel()
    with pytest.raises(asyncio.CancelledError):
        await start
    await d.stop(0)
    assert _left(d) == []


async def test_stop_before_start(daemon_config) -> None:
    d, _ = create_server(daemon_config())
    await d.stop(0)
    assert _left(d) == []


@pytest.mark.parametrize("override, key", [
    ({"host_tier.shm_dir": "/nonexistent-kvk/shm"}, "host_tier.shm_dir"),
    ({"host_tier.shm_dir": "/etc/hostname"}, "host_tier.shm_dir"),
    ({"disk_tier.path": "/etc/hostname"}, "disk_tier.path"),
])
def test_paths_the_system_refuses_are_config_errors(daemon_config, override, key) -> None:
    with pytest.raises(ConfigError) as info:
        create_server(daemon_config(**override))
    assert info.value.key == key
    assert key in str(info.value) and override[key] in str(info.value)


def test_an_arena_too_large_for_its_filesystem_is_a_config_error(daemon_config, tmp_path) -> None:
    with pytest.raises(ConfigError) as info:
        create_server(daemon_config(**{"host_tier.shm_dir": str(tmp_path),
                                       "host_tier.capacity_bytes": "1000TiB",
                                       "host_tier.page_bytes": "64KiB",
                                       "host_tier.prefault": False}))
    assert info.value.key == "host_tier.capacity_bytes"
    assert os.listdir(tmp_path) == []


async def test_a_taken_metrics_port_is_a_config_error_and_nothing_stays(daemon_config, tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        with pytest.raises(ConfigError) as info:
            create_server(daemon_config(**{"metrics.address": f"127.0.0.1:{port}",
                                           "host_tier.shm_dir": str(tmp_path)}))
    assert info.value.key == "metrics.address" and str(port) in str(info.value)
    assert os.listdir(tmp_path) == []


async def test_the_start_up_line_names_the_bound_metrics_port(daemon_config, caplog) -> None:
    d, _ = create_server(daemon_config(**{"metrics.address": "127.0.0.1:0"}))
    try:
        with caplog.at_level(logging.INFO, logger="kvkeeper"):
            await d.start()
        host, port = d.metrics_address.rsplit(":", 1)
        assert host == "127.0.0.1" and int(port) > 0
        (line,) = [r.getMessage() for r in caplog.records if " serving: " in r.getMessage()]
        assert f"metrics={d.metrics_address} " in line
    finally:
        await d.stop(0)


async def test_a_reloaded_gc_interval_takes_effect_without_the_old_wait(daemon_config) -> None:
    d, _ = create_server(daemon_config(**{"server.gc_freeze_interval_seconds": 3600}))
    await d.start()
    try:
        await asyncio.sleep(0.1)            # the ticker is asleep
        ticks = d.gc.ticks
        c = d.config
        d.reload(replace(c, server=replace(c.server, gc_freeze_interval_seconds=0.2)))
        deadline = time.monotonic() + 3.0
        while d.gc.ticks == ticks and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
        assert d.gc.ticks > ticks, "the ticker still sleeps the interval it had before the reload"
    finally:
        await d.stop(0)


async def test_the_arena_gets_the_socket_mode_without_other_bits(daemon_config) -> None:
    # What README.md and deploy/systemd/kvkeeper.service say.
    d, _ = create_server(daemon_config(**{"listen.socket_mode": 0o666}))
    try:
        assert os.stat(d.arena.path).st_mode & 0o777 == 0o660
    finally:
        await d.stop(0)



def _bound_unix_paths() -> set[str]:
    """The paths unix sockets open in this network namespace are bound to
    (/proc/net/unix lists a socket until it is closed, its file removed or not)."""
    with open("/proc/net/unix") as fh:
        return {parts[7] for parts in (line.split() for line in fh.readlines()[1:])
                if len(parts) > 7}


async def test_a_taken_listen_port_closes_the_peer_and_lane_listeners_it_had_opened(
        daemon_config, tmp_path) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = busy.getsockname()[1]
        config = daemon_config(**{"listen.tcp": f"127.0.0.1:{port}",
                                  "host_tier.shm_dir": str(tmp_path)})
        with pytest.raises(ConfigError) as info:
            create_server(config)
    assert info.value.key == "listen.tcp"
    assert os.listdir(tmp_path) == []
    sock = config.listen.socket
    ours = (sock + ".peer", sock + ".match")
    assert not [p for p in (sock, *ours) if os.path.lexists(p)]
    # Closed, not left to the garbage collector (the daemon object may live on
    # in the traceback); gRPC's own listener of `sock` goes with its server.
    assert not _bound_unix_paths() & set(ours)
