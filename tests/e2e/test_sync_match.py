"""The blocking client's leased Match, Release and narrow, sent from the
calling thread (client/sync.py)."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import pytest

from kvkeeper.client import Client, FailedPreconditionError

from lane_data import NS, blocks, keys


async def test_a_leased_match_does_not_go_through_the_event_loop(daemon: Any) -> None:
    def run() -> None:  # in a thread: the daemon serves on this test's event loop
        with Client.connect(f"unix://{daemon.socket_path}", NS, transport="shm") as c:
            ks, bs = keys(3, salt=1), blocks(3, seed=1)
            c.save(ks, bs)
            calls = []
            async_match = c._aclient.match   # noqa: SLF001 - observe which path runs

            def observed(*a: Any, **k: Any) -> Any:
                calls.append(a)
                return async_match(*a, **k)

            c._aclient.match = observed   # noqa: SLF001
            m = c.match(ks + keys(1, salt=2), lease=True, blocks=True, report_use=True)
            assert (m.matched, len(m.blocks)) == (3, 3) and m.lease_id
            views = c.arena_views(m.blocks)
            assert views is not None and [b"".join(v) for v in views] == bs
            assert len(daemon.ledger.leases) == 1
            c.release(m.lease_id)
            assert not daemon.ledger.leases
            miss = c.match(keys(2, salt=9), lease=True, blocks=True)
            assert (miss.matched, miss.lease_id, miss.blocks) == (0, None, [])
            assert calls == []
            assert c.lane is not None and c.lane.calls == 2   # both on the match lane
            assert c.match(ks).matched == 3 and len(calls) == 1   # unleased: as before

    await asyncio.to_thread(run)


async def test_a_leased_match_after_the_daemon_lost_the_session_registers_again(
        daemon: Any) -> None:
    def run() -> None:
        with Client.connect(f"unix://{daemon.socket_path}", NS, transport="shm") as c:
            ks, bs = keys(2, salt=4), blocks(2, seed=4)
            c.save(ks, bs)
            old = c.session_id
            daemon.ledger.expire(time.monotonic() + 10 * daemon.ledger.config.lease_ttl_s)
            m = c.match(ks, lease=True, blocks=True)
            assert (m.matched, len(m.blocks)) == (2, 2) and c.session_id != old
            c.release(m.lease_id)
            assert c.lane is not None and c.lane.calls == 0   # NOT_FOUND there, then gRPC
            assert c.match(ks, lease=True).matched == 2 and c.lane.calls == 1

    # The blocks outlive the session that saved them (they are the daemon's).
    await asyncio.to_thread(run)


async def test_release_and_narrow_do_not_go_through_the_event_loop(daemon: Any) -> None:
    def run() -> None:
        with Client.connect(f"unix://{daemon.socket_path}", NS, transport="shm") as c:
            ks = keys(4, salt=5)
            c.save(ks, blocks(4, seed=5))
            calls = []
            for name in ("release", "narrow"):
                orig = getattr(c._aclient, name)   # noqa: SLF001 - observe which path runs

                def observed(*a: Any, orig: Any = orig, **k: Any) -> Any:
                    calls.append(a)
                    return orig(*a, **k)
                setattr(c._aclient, name, observed)   # noqa: SLF001
            m = c.match(ks, lease=True, blocks=True, report_use=True)
            c.narrow(m.lease_id, 1, 2)
            assert [len(lease.blocks) for lease in daemon.ledger.leases.values()] == [2]
            c.release(m.lease_id, discard_indices=[1], report={
                "prompt_tokens": 128, "prompt_blocks": 4, "local_blocks": 1, "loaded_blocks": 2})
            assert not daemon.ledger.leases
            assert c.match(ks).matched == 2, "a discarded block is gone: the match stops before it"
            with pytest.raises(FailedPreconditionError):
                c.release(m.lease_id)
            assert calls == []

    await asyncio.to_thread(run)


async def test_without_the_lane_a_leased_match_goes_over_grpc(daemon: Any) -> None:
    lane = daemon.lane

    def run(c: Any, ks: list[bytes], lane_calls: int) -> None:
        m = c.match(ks, lease=True, blocks=True)
        assert (m.matched, len(m.blocks)) == (2, 2)
        c.release(m.lease_id)
        assert c.lane.calls == lane_calls and not daemon.ledger.leases

    c = await asyncio.to_thread(Client.connect, f"unix://{daemon.socket_path}", NS,
                                transport="shm")
    try:
        ks = keys(2, salt=6)
        await asyncio.to_thread(c.save, ks, blocks(2, seed=6))
        await asyncio.to_thread(run, c, ks, 1)
        # The lane goes away under an open connection (a daemon stopping it):
        # the next lookup still gets its answer, over gRPC.
        await lane.stop()
        await asyncio.to_thread(run, c, ks, 1)
        await asyncio.to_thread(run, c, ks, 1)   # no lane there: gRPC at once
    finally:
        await asyncio.to_thread(c.close)
