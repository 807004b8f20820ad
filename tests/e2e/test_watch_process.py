"""The client's session watch against a real daemon: a client process killed
outright has its lease freed as soon as its connection is gone, not a lease
TTL (30 s) later; a client that closes says so; a client whose session ended
or whose daemon restarted registers again without waiting for a heartbeat."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import sys
import time
from pathlib import Path
from typing import Any, Callable

import pytest

from kvkeeper.client import AsyncClient
from kvkeeper.server.app import create_server

HOLDER = Path(__file__).with_name("lease_holder.py")
NS = {"model_id": "watch-e2e", "dtype": "float16", "kv_layout": "NHD", "block_tokens": 32,
      "block_bytes": 4096}
# A bound on conditions that come within a second; well under the lease TTL
# (30 s), so nothing here can pass by expiry.
POLL_S = 10.0


async def until(cond: Callable[[], bool], what: str, timeout: float = POLL_S) -> float:
    """Poll `cond` until it holds; returns the seconds it took."""
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, what
        await asyncio.sleep(0.005)
    return time.monotonic() - t0


def watched(daemon: Any, sid: str) -> bool:
    s = daemon.ledger.sessions.get(sid)
    return s is not None and bool(s.watches)


@pytest.mark.parametrize("over", ["unix", "tcp"])
async def test_a_killed_client_process_has_its_lease_freed_at_once(daemon: Any, over: str) -> None:
    url = f"unix://{daemon.socket_path}" if over == "unix" else f"127.0.0.1:{daemon.port}"
    assert daemon.ledger.config.lease_ttl_s >= 3 * POLL_S
    proc = await asyncio.create_subprocess_exec(sys.executable, str(HOLDER), url,
                                                stdout=asyncio.subprocess.PIPE,
                                                env={**os.environ})
    try:
        assert proc.stdout is not None
        line = await asyncio.wait_for(proc.stdout.readline(), timeout=120.0)
        held = json.loads(line)
        L = daemon.ledger
        assert held["lease"] in L.leases
        await until(lambda: watched(daemon, held["session"]), "the client never watched")
        proc.send_signal(signal.SIGKILL)
        freed = await until(lambda: held["lease"] not in L.leases, "the lease stayed pinned")
    finally:
        if proc.returncode is None:
            proc.kill()
        await proc.wait()
    assert held["session"] not in L.sessions
    assert L.session_ends["disconnected"] == 1 and L.sessions_expired == 0
    assert L.top.evictable_pages == L.top.used_pages > 0, "released, not discarded"
    L.check_invariants()
    print(f"\nsession watch ({over}): lease freed {freed:.3f} s after SIGKILL of its client")


async def test_a_client_that_closes_ends_its_session_as_closed(daemon: Any) -> None:
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", NS)
    sid = c.session_id
    await until(lambda: watched(daemon, sid), "the client never watched")
    await c.close()
    assert sid not in daemon.ledger.sessions
    ends = daemon.ledger.session_ends
    assert (ends["closed"], ends["disconnected"]) == (1, 0)


async def test_a_session_the_daemon_ended_is_registered_again_from_the_watch(daemon: Any) -> None:
    """The daemon expires the session: the watch is told, and the client
    registers again at once, not at its next heartbeat (TTL/3 = 10 s)."""
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", NS)
    try:
        old = c.session_id
        await until(lambda: watched(daemon, old), "the client never watched")
        daemon.ledger.expire(time.monotonic() + 10 * daemon.ledger.config.lease_ttl_s)
        await until(lambda: c.session_id != old and watched(daemon, c.session_id),
                    "the client did not register again", timeout=3.0)
        assert (await c.match([b"\x01" * 32])).matched == 0
    finally:
        await c.close()


async def test_a_restarted_daemon_gets_the_session_back_without_a_call(daemon_config: Any) -> None:
    config = daemon_config()
    first, _ = create_server(config)
    await first.start()
    c = await AsyncClient.connect(f"unix://{config.listen.socket}", NS)
    try:
        old = c.session_id
        await until(lambda: watched(first, old), "the client never watched")
        await first.stop(0)
        second, _ = create_server(daemon_config())   # the same socket, a new arena
        await second.start()
        try:
            back = await until(lambda: len(second.ledger.sessions) == 1 and
                               watched(second, c.session_id),
                               "no session on the restarted daemon", timeout=3.0)
            assert c.session_id != old
            print(f"\nsession watch: registered again {back:.3f} s after the daemon restarted")
        finally:
            await c.close()
            await second.stop(0)
    finally:
        await c.close()
        await first.stop(0)
