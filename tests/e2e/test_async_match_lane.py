"""AsyncClient's Match on the daemon's match lane (client/match_lane.py,
server/api/match_lane.py): the same answers as over gRPC, re-registration
when the daemon lost the session, and gRPC when the lane is gone."""
from __future__ import annotations

import time
from typing import Any

from kvkeeper.client import AsyncClient

from lane_data import NS, blocks, keys


async def connect(daemon: Any) -> Any:
    return await AsyncClient.connect(f"unix://{daemon.socket_path}", NS, transport="shm")


async def test_every_match_goes_on_the_lane_with_grpcs_answers(daemon: Any) -> None:
    c = await connect(daemon)
    try:
        lane = c._session.lane   # noqa: SLF001 - observe which path runs
        assert lane is not None
        ks, bs = keys(3, salt=1), blocks(3, seed=1)
        await c.save(ks, bs)
        m = await c.match(ks + keys(2, salt=2))
        assert (m.matched, m.lease_id, lane.calls) == (3, None, 1)
        m = await c.match(ks, lease=True, blocks=True)
        assert m.matched == 3 and m.lease_id and len(m.blocks) == 3 and lane.calls == 2
        views = c.arena_views(m.blocks)
        assert views is not None and [b"".join(v) for v in views] == bs
        assert daemon.ledger.leases
        await c.release(m.lease_id)
        assert not daemon.ledger.leases
        # A key of the wrong size is the caller's error, checked before any call.
        try:
            await c.match([b"short"])
        except ValueError:
            pass
        else:
            raise AssertionError("a short key was accepted")
        assert lane.calls == 2
    finally:
        await c.close()


async def test_a_lost_session_registers_again_and_the_lane_goes_on(daemon: Any) -> None:
    c = await connect(daemon)
    try:
        lane = c._session.lane   # noqa: SLF001
        ks = keys(2, salt=4)
        await c.save(ks, blocks(2, seed=4))
        old = c.session_id
        daemon.ledger.expire(time.monotonic() + 10 * daemon.ledger.config.lease_ttl_s)
        # NOT_FOUND on the lane, then RegisterSession, then the lane again.
        m = await c.match(ks, lease=True)
        assert m.matched == 2 and c.session_id != old and lane.calls == 1
        await c.release(m.lease_id)
    finally:
        await c.close()


async def test_without_the_lane_a_match_goes_over_grpc(daemon: Any) -> None:
    c = await connect(daemon)
    try:
        lane = c._session.lane   # noqa: SLF001
        ks = keys(2, salt=6)
        await c.save(ks, blocks(2, seed=6))
        assert (await c.match(ks)).matched == 2 and lane.calls == 1
        await daemon.lane.stop()   # under the client's open connection
        for _ in range(3):
            m = await c.match(ks, lease=True, blocks=True)
            assert (m.matched, len(m.blocks)) == (2, 2)
            await c.release(m.lease_id)
        assert lane.calls == 1 and not daemon.ledger.leases
    finally:
        await c.close()
    assert lane._idle == []   # noqa: SLF001 - closed with the client
