"""The residency service on the wire (ReportResidency, Locate, WatchEvents),
and what Match, Stats and the metrics say of the gpu tier. Raw stubs on the
real daemon's socket."""
from __future__ import annotations

import asyncio
from typing import Any, AsyncIterator

import grpc
import pytest

from kvkeeper.server.ledger.residency import Change
from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc
from kvkeeper.v1 import residency_pb2 as rpb
from kvkeeper.v1 import residency_pb2_grpc as rpb_grpc

BLOCK = 4096
STORED, REMOVED, CLEARED = rpb.RESIDENCY_STORED, rpb.RESIDENCY_REMOVED, rpb.RESIDENCY_CLEARED
WAIT_S = 10.0   # a bound on what comes within milliseconds


def descriptor(model: str = "residency-test") -> pb.NamespaceDescriptor:
    return pb.NamespaceDescriptor(model_id=model, block_tokens=32, block_bytes=BLOCK)


def key(i: int) -> bytes:
    return i.to_bytes(4, "little") * 8


@pytest.fixture
async def channel(daemon: Any) -> AsyncIterator[Any]:
    async with grpc.aio.insecure_channel(f"unix:{daemon.socket_path}") as ch:
        yield ch


async def register(ch: Any, name: str, model: str = "residency-test") -> tuple[str, bytes]:
    r = await pb_grpc.KVKeeperStub(ch).RegisterSession(pb.RegisterSessionRequest(
        instance_id=name, namespace=descriptor(model)))
    return r.session_id, r.namespace_id


async def report(ch: Any, sid: str, *changes: tuple[int, list[int]], cap: int = 64,
                 seq: int = 0) -> Any:
    req = rpb.ReportResidencyRequest(session_id=sid, capacity_blocks=cap, report_seq=seq)
    for kind, ks in changes:
        req.changes.add(kind=kind, keys=[key(i) for i in ks])
    return await rpb_grpc.KVKeeperResidencyStub(ch).ReportResidency(req)


async def save(ch: Any, sid: str, ks: list[int]) -> None:
    stub = pb_grpc.KVKeeperStub(ch)
    r = await stub.ReserveSave(pb.ReserveSaveRequest(
        session_id=sid, keys=[key(i) for i in ks], transport=pb.TRANSPORT_STREAM))

    async def chunks():
        for j in range(len(ks)):
            yield pb.WriteChunk(session_id=sid, reservation_id=r.reservation_id, index=j,
                                data=bytes(BLOCK))
    await stub.WriteBlocks(chunks())
    await stub.CommitSave(pb.CommitSaveRequest(session_id=sid, reservation_id=r.reservation_id))


async def test_locate_names_each_engines_prefix_and_the_tiers(channel: Any) -> None:
    a, ns = await register(channel, "engine a")
    b, _ = await register(channel, "engine b")
    ra = await report(channel, a, (STORED, [0, 1, 2, 3]))
    rb = await report(channel, b, (STORED, [0, 1]))
    assert ra.applied and ra.resident_blocks == 4 and ra.engine.startswith("s")
    await save(channel, a, [0, 1, 2])
    stub = rpb_grpc.KVKeeperResidencyStub(channel)
    keys = [key(i) for i in range(6)]
    for req in (rpb.LocateRequest(descriptor=descriptor(), keys=keys),
                rpb.LocateRequest(namespace_id=ns, keys=keys)):
        resp = await stub.Locate(req)
        assert resp.namespace_id == ns
        assert [(e.engine, e.instance_id, e.prefix) for e in resp.engines] == \
            [(ra.engine, "engine a", 4), (rb.engine, "engine b", 2)]
        assert [(t.tier, t.prefix) for t in resp.tiers] == [(pb.TIER_HOST, 3)]
        assert resp.stored == 3
    # Locate is read-only: no lookup counted.
    stats = await pb_grpc.KVKeeperStub(channel).Stats(pb.StatsRequest())
    assert stats.lookups == 0


async def test_match_reports_the_gpu_tier_of_another_engine(channel: Any) -> None:
    a, _ = await register(channel, "a")
    b, _ = await register(channel, "b")
    ra = await report(channel, a, (STORED, [0, 1, 2]))
    await save(channel, b, [0])
    m = await pb_grpc.KVKeeperStub(channel).Match(pb.MatchRequest(
        session_id=b, keys=[key(i) for i in range(4)]))
    assert (m.matched, m.gpu_matched, m.gpu_engine) == (1, 3, ra.engine)
    own = await pb_grpc.KVKeeperStub(channel).Match(pb.MatchRequest(
        session_id=a, keys=[key(i) for i in range(4)]))
    assert (own.gpu_matched, own.gpu_engine) == (0, "")   # not its own cache


async def test_stats_and_metrics_show_each_engines_book(daemon: Any, channel: Any) -> None:
    a, ns = await register(channel, "engine a")
    ra = await report(channel, a, (STORED, [0, 1, 2]), cap=10)
    stats = await pb_grpc.KVKeeperStub(channel).Stats(pb.StatsRequest())
    assert [(e.engine, e.instance_id, e.namespace_id, e.resident_blocks, e.resident_bytes,
             e.capacity_blocks) for e in stats.engines] == \
        [(ra.engine, "engine a", ns, 3, 3 * BLOCK, 10)]
    text = daemon.metrics.render().decode()
    assert f'kvkeeper_gpu_resident_blocks{{engine="{ra.engine}"}} 3.0' in text
    assert f'kvkeeper_gpu_resident_bytes{{engine="{ra.engine}"}} {3.0 * BLOCK}' in text
    assert "kvkeeper_gpu_engines 1.0" in text
    await pb_grpc.KVKeeperStub(channel).CloseSession(pb.CloseSessionRequest(session_id=a))
    text = daemon.metrics.render().decode()
    assert "kvkeeper_gpu_resident_blocks{" not in text and "kvkeeper_gpu_engines 0.0" in text


@pytest.mark.parametrize("req, code", [
    (rpb.ReportResidencyRequest(session_id="1-nope", capacity_blocks=4),
     grpc.StatusCode.NOT_FOUND),
])
async def test_report_errors(channel: Any, req: Any, code: Any) -> None:
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await rpb_grpc.KVKeeperResidencyStub(channel).ReportResidency(req)
    assert e.value.code() == code


async def test_a_bad_report_is_invalid_argument_and_changes_nothing(daemon: Any,
                                                                    channel: Any) -> None:
    a, _ = await register(channel, "a")
    await report(channel, a, (STORED, [0]))
    before = daemon.ledger.residency.log.last_seq
    for req in (rpb.ReportResidencyRequest(session_id=a, changes=[rpb.ResidencyChange(kind=9)]),
                rpb.ReportResidencyRequest(session_id=a, changes=[rpb.ResidencyChange(
                    kind=STORED, keys=[key(1)], block_ids=[64])])):
        with pytest.raises(grpc.aio.AioRpcError) as e:
            await rpb_grpc.KVKeeperResidencyStub(channel).ReportResidency(req)
        assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT
    assert daemon.ledger.residency.log.last_seq == before
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await rpb_grpc.KVKeeperResidencyStub(channel).Locate(rpb.LocateRequest(keys=[key(0)]))
    assert e.value.code() == grpc.StatusCode.INVALID_ARGUMENT


class Watcher:
    """One WatchEvents call, read message by message."""

    def __init__(self, ch: Any, **req: Any) -> None:
        self.call = rpb_grpc.KVKeeperResidencyStub(ch).WatchEvents(rpb.WatchEventsRequest(**req))

    async def next(self) -> Any:
        return await asyncio.wait_for(self.call.read(), WAIT_S)

    async def events(self, n: int) -> list[Any]:
        out: list[Any] = []
        while len(out) < n:
            msg = await self.next()
            assert not msg.HasField("gap")
            out += list(msg.events)
        return out


async def test_watch_streams_events_and_resumes_with_none_lost_or_repeated(channel: Any) -> None:
    a, ns = await register(channel, "a")
    w = Watcher(channel)
    head = await w.next()
    assert not head.events and not head.HasField("gap") and head.epoch
    ra = await report(channel, a, (STORED, [0, 1]), (REMOVED, [1]))
    got = await w.events(2)
    assert [(e.kind, e.engine, e.tier, list(e.keys), e.namespace_id) for e in got] == \
        [(STORED, ra.engine, pb.TIER_GPU, [key(0), key(1)], ns),
         (REMOVED, ra.engine, pb.TIER_GPU, [key(1)], ns)]
    seqs = [e.seq for e in got]
    assert seqs == [seqs[0], seqs[0] + 1]
    w.call.cancel()
    # While nobody watches: more changes, then the session ends.
    await report(channel, a, (STORED, [5]), (CLEARED, []))
    await pb_grpc.KVKeeperStub(channel).CloseSession(pb.CloseSessionRequest(session_id=a))
    w2 = Watcher(channel, resume=True, epoch=head.epoch, after_seq=seqs[-1])
    head2 = await w2.next()
    assert not head2.HasField("gap") and head2.last_seq == seqs[-1]
    more = await w2.events(3)
    assert [e.seq for e in more] == [seqs[-1] + 1, seqs[-1] + 2, seqs[-1] + 3]
    assert [e.kind for e in more] == [STORED, CLEARED, CLEARED]   # the last: the session ended
    # And live again after the replay.
    b, _ = await register(channel, "b")
    await report(channel, b, (STORED, [7]))
    (live,) = await w2.events(1)
    assert live.seq == seqs[-1] + 4 and list(live.keys) == [key(7)]
    w2.call.cancel()


async def test_a_resume_past_the_buffer_reports_the_gap(daemon: Any, channel: Any) -> None:
    daemon.ledger.residency.log.capacity_keys = 4
    a, _ = await register(channel, "a")
    for i in range(6):
        await report(channel, a, (STORED, [i, i + 10]))   # 2 keys each: the last 2 stay
    w = Watcher(channel, resume=True, epoch=daemon.ledger.residency.log.epoch, after_seq=1)
    head = await w.next()
    assert (head.gap.first_seq, head.gap.last_seq, head.gap.restarted) == (2, 4, False)
    assert head.last_seq == 4
    assert [e.seq for e in await w.events(2)] == [5, 6]
    w.call.cancel()


async def test_a_lagging_watcher_is_told_of_the_events_it_lost(daemon: Any,
                                                               channel: Any) -> None:
    log = daemon.ledger.residency.log
    log.capacity_keys = 2
    sid, _ = await register(channel, "a")
    w = Watcher(channel)
    await w.next()
    # Three reports in one loop turn: the watcher wakes after all, 2 were dropped.
    owner = daemon.ledger.sessions[sid].owner
    for i in range(3):
        daemon.ledger.report_residency(sid, [Change("stored", [key(i), key(i + 10)])],
                                       0.0, capacity_blocks=64, owner=owner)
    msg = await w.next()
    assert (msg.gap.first_seq, msg.gap.last_seq) == (1, 2)
    (e,) = await w.events(1)
    assert e.seq == 3
    w.call.cancel()


async def test_a_resume_from_another_epoch_or_past_the_newest(daemon: Any, channel: Any) -> None:
    a, _ = await register(channel, "a")
    await report(channel, a, (STORED, [0]))
    w = Watcher(channel, resume=True, epoch="another-daemon", after_seq=12)
    head = await w.next()
    assert head.gap.restarted and head.epoch == daemon.ledger.residency.log.epoch
    (e,) = await w.events(1)
    assert e.seq == 1
    w.call.cancel()
    w = Watcher(channel, resume=True, epoch=head.epoch, after_seq=2)
    with pytest.raises(grpc.aio.AioRpcError) as err:
        await w.next()
    assert err.value.code() == grpc.StatusCode.OUT_OF_RANGE


async def test_a_namespace_filter_leaves_other_namespaces_out(channel: Any) -> None:
    a, ns = await register(channel, "a")
    b, _ = await register(channel, "b", model="other-model")
    w = Watcher(channel, namespace_id=ns)
    await w.next()
    await report(channel, b, (STORED, [1]))
    await report(channel, a, (STORED, [2]))
    (e,) = await w.events(1)
    assert list(e.keys) == [key(2)] and e.namespace_id == ns
    w.call.cancel()


async def test_a_stopping_daemon_ends_watches_unavailable(daemon: Any, channel: Any) -> None:
    w = Watcher(channel)
    await w.next()
    await daemon.stop(0)
    with pytest.raises(grpc.aio.AioRpcError) as e:
        await w.next()
    assert e.value.code() == grpc.StatusCode.UNAVAILABLE


async def test_the_host_tier_streams_its_commits(channel: Any) -> None:
    a, ns = await register(channel, "a")
    w = Watcher(channel)
    await w.next()
    await save(channel, a, [0, 1])
    (e,) = await w.events(1)
    assert (e.tier, e.engine, e.kind, list(e.keys), e.namespace_id) == \
        (pb.TIER_HOST, "", STORED, [key(0), key(1)], ns)
    w.call.cancel()


async def test_the_clients_match_carries_the_gpu_tier(daemon: Any) -> None:
    from kvkeeper.client import AsyncClient

    ns = {"model_id": "residency-test", "block_tokens": 32, "block_bytes": BLOCK}
    url = f"unix://{daemon.socket_path}"
    a = await AsyncClient.connect(url, ns, instance_id="a")
    b = await AsyncClient.connect(url, ns, instance_id="b")
    try:
        resp, sid = await a.report_residency([("stored", [key(0), key(1)])], capacity_blocks=4)
        assert sid == a.session_id and resp.applied
        for lease in (False, True):
            m = await b.match([key(0), key(1), key(2)], lease=lease)
            assert (m.matched, m.gpu_matched, m.gpu_engine) == (0, 2, resp.engine)
        again, _ = await a.report_residency([("cleared", [])], report_seq=0)
        assert again.resident_blocks == 0
        assert (await b.match([key(0)])).gpu_matched == 0
    finally:
        await a.close()
        await b.close()
