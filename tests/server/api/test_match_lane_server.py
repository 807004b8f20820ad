"""The match lane (api/match_lane.py) on the wire: the same answer as Match over
gRPC, the same statuses and metrics, a malformed or refused request changes
nothing, a broken frame ends only its connection, and no lane with tokens."""
from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import struct
from typing import Any, Tuple

import grpc
import pytest
from test_servicer_errors import key, snapshot
from test_servicer_match_blocks import saved

from kvkeeper.client.match_lane import lane_path
from kvkeeper.v1 import kvkeeper_pb2 as pb

LEN = struct.Struct("<I")


async def lane_call(daemon: Any, body: bytes,
                    conn: Any = None) -> Tuple[grpc.StatusCode, bytes, Any]:
    """(status, answer body, the connection, for another call) of one frame."""
    if conn is None:
        conn = await asyncio.open_unix_connection(lane_path(daemon.socket_path))
    reader, writer = conn
    writer.write(LEN.pack(len(body)) + body)
    n = LEN.unpack(await reader.readexactly(4))[0]
    answer = await reader.readexactly(n)
    codes = {c.value[0]: c for c in grpc.StatusCode}
    return codes[answer[0]], answer[1:], conn


def match_count(daemon: Any) -> float:
    return daemon.metrics.registry.get_sample_value(
        "kvkeeper_rpc_duration_seconds_count", {"method": "Match"}) or 0.0


def lane_series(daemon: Any) -> Tuple[Any, Any]:
    """(kvkeeper_match_lane_requests_total, kvkeeper_match_lane_connections)."""
    get = daemon.metrics.registry.get_sample_value
    return get("kvkeeper_match_lane_requests_total"), get("kvkeeper_match_lane_connections")


async def test_the_lane_answers_what_grpc_answers(daemon: Any, stub: Any) -> None:
    sid, ks = await saved(stub, 3)
    path = lane_path(daemon.socket_path)
    assert oct(os.stat(path).st_mode & 0o777) == oct(daemon.config.listen.socket_mode & 0o777)
    req = pb.MatchRequest(session_id=sid, keys=ks + [key(99)], lease=True, blocks=True)
    via_grpc = await stub.Match(req)
    calls = match_count(daemon)
    assert lane_series(daemon) == (0.0, 0.0)   # the gRPC call is not the lane's
    code, body, (_, writer) = await lane_call(daemon, req.SerializeToString())
    assert lane_series(daemon) == (1.0, 1.0)
    writer.close()
    await writer.wait_closed()
    for _ in range(100):   # the daemon sees the connection end
        if lane_series(daemon)[1] == 0.0:
            break
        await asyncio.sleep(0.01)
    assert lane_series(daemon) == (1.0, 0.0)
    assert code == grpc.StatusCode.OK
    via_lane = pb.MatchResponse.FromString(body)
    assert via_lane.matched == via_grpc.matched == 3
    assert list(via_lane.tiers) == list(via_grpc.tiers)
    assert list(via_lane.blocks) == list(via_grpc.blocks)   # keys, extents, checksums
    assert via_lane.lease_id and via_lane.lease_id != via_grpc.lease_id
    assert match_count(daemon) == calls + 1   # timed as the gRPC call is
    # Both leases are real: each pins the blocks until released.
    for lid in (via_grpc.lease_id, via_lane.lease_id):
        assert lid in daemon.ledger.leases
        await stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=lid))
    daemon.ledger.check_invariants()
    # Without a lease the answer is the short one, as over gRPC.
    code, body, _ = await lane_call(daemon, pb.MatchRequest(session_id=sid, keys=ks)
                                    .SerializeToString())
    assert code == grpc.StatusCode.OK and pb.MatchResponse.FromString(body).matched == 3


async def test_refused_requests_change_nothing_and_keep_the_connection(daemon: Any,
                                                                       stub: Any) -> None:
    sid, ks = await saved(stub, 2)
    before = snapshot(daemon)
    code, body, conn = await lane_call(daemon, b"\xff\xff not a MatchRequest")
    assert code == grpc.StatusCode.INVALID_ARGUMENT
    assert b"malformed KVKeeper/Match request" in body
    code, body, conn = await lane_call(daemon, pb.MatchRequest(
        session_id="nope", keys=ks, lease=True).SerializeToString(), conn)
    assert code == grpc.StatusCode.NOT_FOUND and b"unknown session" in body
    code, body, conn = await lane_call(daemon, pb.MatchRequest(
        session_id=sid, keys=[ks[0], b"short"], lease=True).SerializeToString(), conn)
    assert code == grpc.StatusCode.INVALID_ARGUMENT and b"32 bytes" in body
    assert snapshot(daemon) == before
    daemon.servicer.serving = False   # draining
    try:
        code, body, conn = await lane_call(daemon, pb.MatchRequest(
            session_id=sid, keys=ks, lease=True).SerializeToString(), conn)
    finally:
        daemon.servicer.serving = True
    assert code == grpc.StatusCode.UNAVAILABLE and b"shutting down" in body
    assert snapshot(daemon) == before
    code, body, (_, writer) = await lane_call(daemon, pb.MatchRequest(
        session_id=sid, keys=ks).SerializeToString(), conn)
    writer.close()
    assert code == grpc.StatusCode.OK


async def test_a_frame_over_the_limit_ends_its_connection_only(daemon: Any, stub: Any) -> None:
    sid, ks = await saved(stub, 1)
    reader, writer = await asyncio.open_unix_connection(lane_path(daemon.socket_path))
    writer.write(LEN.pack(daemon.config.server.max_message_bytes + 1))
    assert await reader.read() == b""   # closed without an answer
    writer.close()
    code, _, (_, w2) = await lane_call(daemon, pb.MatchRequest(session_id=sid, keys=ks)
                                       .SerializeToString())
    w2.close()
    assert code == grpc.StatusCode.OK


async def test_no_lane_with_tokens_and_none_left_after_stop(daemon_factory: Any,
                                                            tmp_path: Any) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text('[tokens.a]\ntoken = "lane-test-0123456789abcdef"\nmodels = ["*"]\n')
    tokens.chmod(0o600)
    d = await daemon_factory(**{"auth.tokens_file": str(tokens)})
    assert d.lane is None and not os.path.lexists(lane_path(d.socket_path))
    plain = await daemon_factory()
    path = lane_path(plain.socket_path)
    assert os.path.exists(path)
    conn = await asyncio.open_unix_connection(path)
    await plain.stop(0)
    assert not os.path.lexists(path)
    assert await conn[0].read() == b""   # open connections are closed
    conn[1].close()
    with pytest.raises(OSError):
        await asyncio.open_unix_connection(path)


async def test_the_lane_series_pass_promtool(daemon: Any) -> None:
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing: .ci/run must install prometheus")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    text = daemon.metrics.render()
    assert b"kvkeeper_match_lane_requests_total 0.0" in text
    assert b"kvkeeper_match_lane_connections 0.0" in text
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          timeout=60)
    assert proc.returncode == 0 and not proc.stdout.strip() and not proc.stderr.strip(), \
        (proc.stdout + proc.stderr).decode()
