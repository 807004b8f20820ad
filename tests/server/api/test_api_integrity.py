"""Inputs that could make the daemon store or serve the wrong bytes, or show a
tenant another's, each refused with a client status and no state changed:
a lease narrowed under its own LoadStream, a WriteChunk naming another
reservation, a packed chunk over an entry that is not reserved, checksums no
reader can verify, a Load answer too big to send, and Stats under tokens."""
from __future__ import annotations

from typing import Any, AsyncIterator

import grpc
import pytest
from test_residency_auth import TOKENS, TOKEN_A, TOKEN_OPS, md
from test_servicer_errors import expect, key, snapshot

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc
from kvkeeper.v1 import residency_pb2 as rpb
from kvkeeper.v1 import residency_pb2_grpc as rpb_grpc

PAGE = 4096
INVALID, PRECONDITION = grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION


async def register(stub: Any, model: str = "m", block_bytes: int = PAGE,
                   metadata: Any = None) -> str:
    return (await stub.RegisterSession(pb.RegisterSessionRequest(
        instance_id="t", namespace=pb.NamespaceDescriptor(
            model_id=model, block_tokens=16, block_bytes=block_bytes)),
        metadata=metadata)).session_id


async def reserve(stub: Any, sid: str, keys: list) -> Any:
    return await stub.ReserveSave(pb.ReserveSaveRequest(session_id=sid, keys=keys,
                                                        transport=pb.TRANSPORT_STREAM))


async def save(stub: Any, sid: str, keys: list, fill: bytes) -> None:
    for i in range(0, len(keys), 100):
        part = keys[i:i + 100]
        r = await reserve(stub, sid, part)

        async def chunks(r: Any = r, n: int = len(part)) -> AsyncIterator[pb.WriteChunk]:
            for j in range(n):
                yield pb.WriteChunk(session_id=sid, reservation_id=r.reservation_id, index=j,
                                    data=fill * PAGE)
        await stub.WriteBlocks(chunks())
        await stub.CommitSave(pb.CommitSaveRequest(session_id=sid,
                                                   reservation_id=r.reservation_id))


async def with_tokens(daemon_factory: Any, tmp_path: Any) -> Any:
    """A daemon with test_residency_auth's tokens file: (daemon, the file's path)."""
    path = tmp_path / "tokens.toml"
    path.write_text(TOKENS)
    path.chmod(0o600)
    return await daemon_factory(**{"auth.tokens_file": str(path)}), path


async def test_a_lease_narrowed_under_its_stream_ends_the_stream(daemon_factory: Any) -> None:
    n = 300
    d = await daemon_factory(**{"host_tier.capacity_bytes": PAGE + n * PAGE,
                                "ledger.eviction_policy": "lru"})
    async with grpc.aio.insecure_channel(f"unix:{d.socket_path}") as ch:
        stub = pb_grpc.KVKeeperStub(ch)
        sid, other = await register(stub), await register(stub, model="another-model")
        ks = [key(i) for i in range(1, n + 1)]
        await save(stub, sid, ks, b"o")
        m = await stub.Match(pb.MatchRequest(session_id=sid, keys=ks, lease=True))
        call = stub.LoadStream(pb.LoadRequest(session_id=sid, lease_id=m.lease_id))
        assert bytes((await call.read()).data[:1]) == b"o"
        await stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=m.lease_id,
                                             keep_start=0, keep_blocks=1))
        # Another namespace's save takes the pages the narrow unpinned.
        await save(stub, other, [key(i) for i in range(1000, 1000 + n - 1)], b"Z")
        got = []
        try:
            while (c := await call.read()) is not grpc.aio.EOF:
                got.append(bytes(c.data[:1]))
        except grpc.aio.AioRpcError as e:
            assert e.code() == PRECONDITION and "narrowed" in e.details()
        else:
            raise AssertionError("the stream went on after its lease was narrowed")
        assert b"Z" not in got
        d.ledger.check_invariants()


async def test_a_chunk_naming_another_reservation_is_refused(daemon: Any, stub: Any) -> None:
    sid = await register(stub)
    a = await reserve(stub, sid, [key(1), key(2)])
    b = await reserve(stub, sid, [key(3), key(4)])

    async def chunks() -> AsyncIterator[pb.WriteChunk]:
        yield pb.WriteChunk(session_id=sid, reservation_id=a.reservation_id, index=0,
                            data=b"A" * PAGE)
        yield pb.WriteChunk(session_id=sid, reservation_id=b.reservation_id, index=1,
                            data=b"B" * PAGE)   # meant for b's entry 1
    await expect(INVALID, stub.WriteBlocks(chunks()), "one WriteBlocks per reservation")
    assert daemon.ledger.reservations[a.reservation_id].written == [PAGE, 0]
    assert daemon.ledger.reservations[b.reservation_id].written == [0, 0]
    # Later chunks that leave both empty are the stream's own, as before.

    async def rest() -> AsyncIterator[pb.WriteChunk]:
        yield pb.WriteChunk(session_id=sid, reservation_id=b.reservation_id, index=0,
                            data=b"B" * PAGE)
        yield pb.WriteChunk(index=1, data=b"B" * PAGE)
    assert (await stub.WriteBlocks(rest())).bytes_written == 2 * PAGE


async def test_a_packed_chunk_that_fails_records_none_of_its_blocks(daemon: Any,
                                                                    stub: Any) -> None:
    sid = await register(stub)
    await save(stub, sid, [key(2)], b"p")   # present: its slot is skipped
    r = await reserve(stub, sid, [key(1), key(2), key(3)])
    res = daemon.ledger.reservations[r.reservation_id]
    before = snapshot(daemon), list(res.written)

    async def packed() -> AsyncIterator[pb.WriteChunk]:
        yield pb.WriteChunk(session_id=sid, reservation_id=r.reservation_id, index=0,
                            data=b"x" * (2 * PAGE))   # entries 0 and 1: 1 is not reserved
    await expect(INVALID, stub.WriteBlocks(packed()), "key 1")
    assert (snapshot(daemon), res.written) == before

    async def retry() -> AsyncIterator[pb.WriteChunk]:
        yield pb.WriteChunk(session_id=sid, reservation_id=r.reservation_id, index=0,
                            data=b"y" * PAGE)
        yield pb.WriteChunk(index=2, data=b"y" * PAGE)
    await stub.WriteBlocks(retry())
    assert (await stub.CommitSave(pb.CommitSaveRequest(
        session_id=sid, reservation_id=r.reservation_id))).committed == 2


async def test_an_unknown_transport_is_refused(daemon: Any, stub: Any) -> None:
    sid = await register(stub)
    before = snapshot(daemon)
    await expect(INVALID, stub.ReserveSave(pb.ReserveSaveRequest(
        session_id=sid, keys=[key(1)], transport=7)), "transport 7 is unknown")
    assert snapshot(daemon) == before


async def test_checksums_no_reader_can_verify_are_refused(daemon: Any, stub: Any) -> None:
    sid = await register(stub)
    r = await reserve(stub, sid, [key(1)])
    await stub.WriteBlocks(iter([pb.WriteChunk(session_id=sid, reservation_id=r.reservation_id,
                                               index=0, data=b"c" * PAGE)]))
    before = snapshot(daemon)
    rid = r.reservation_id
    for algo, value, fragment in ((99, 1, "algorithm 99 is unknown"),
                                  (pb.CHECKSUM_CRC32, 1 << 32, "does not fit algorithm 1"),
                                  (pb.CHECKSUM_NONE, 7, "with CHECKSUM_NONE")):
        await expect(INVALID, stub.CommitSave(pb.CommitSaveRequest(
            session_id=sid, reservation_id=rid, checksum_algo=algo, checksums=[value])),
            fragment)
        assert snapshot(daemon) == before
    # Zeros under CHECKSUM_NONE are no checksum; a 64-bit XXH3 value fits.
    assert (await stub.CommitSave(pb.CommitSaveRequest(
        session_id=sid, reservation_id=rid, checksum_algo=pb.CHECKSUM_NONE,
        checksums=[0]))).committed == 1
    r = await reserve(stub, sid, [key(2)])
    await stub.WriteBlocks(iter([pb.WriteChunk(session_id=sid, reservation_id=r.reservation_id,
                                               index=0, data=b"c" * PAGE)]))
    assert (await stub.CommitSave(pb.CommitSaveRequest(
        session_id=sid, reservation_id=r.reservation_id, checksum_algo=pb.CHECKSUM_XXH3_64,
        checksums=[(1 << 64) - 1]))).committed == 1


async def test_a_load_too_big_to_send_hands_out_nothing(daemon: Any, stub: Any) -> None:
    sid = await register(stub)
    ks = [key(i) for i in range(40)]
    await save(stub, sid, ks, b"l")
    m = await stub.Match(pb.MatchRequest(session_id=sid, keys=ks, lease=True))
    lease = daemon.ledger.leases[m.lease_id]
    daemon.servicer.max_message_bytes = 200
    loads = daemon.metrics.registry.get_sample_value

    def loaded() -> Any:
        return loads("kvkeeper_transfer_bytes_total", {"direction": "load", "transport": "shm"})
    before = loaded()
    await expect(grpc.StatusCode.RESOURCE_EXHAUSTED,
                 stub.Load(pb.LoadRequest(session_id=sid, lease_id=m.lease_id)), "LoadStream")
    assert not lease.refs_out and loaded() == before


async def test_stats_shows_a_tenant_only_its_own_engines(daemon_factory: Any,
                                                         tmp_path: Any) -> None:
    d, path = await with_tokens(daemon_factory, tmp_path)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{d.port}") as ch:
        data, res = pb_grpc.KVKeeperStub(ch), rpb_grpc.KVKeeperResidencyStub(ch)
        for token, model, host in ((TOKEN_A, "model-a", "host-a"),
                                   (TOKEN_OPS, "model-b", "secret-host-b")):
            sid = (await data.RegisterSession(pb.RegisterSessionRequest(
                instance_id=host, namespace=pb.NamespaceDescriptor(
                    model_id=model, block_tokens=32, block_bytes=4096)),
                metadata=md(token))).session_id
            await res.ReportResidency(rpb.ReportResidencyRequest(
                session_id=sid, capacity_blocks=4, changes=[rpb.ResidencyChange(
                    kind=rpb.RESIDENCY_STORED, keys=[bytes(32)])]), metadata=md(token))
        seen_a = await data.Stats(pb.StatsRequest(), metadata=md(TOKEN_A))
        seen_ops = await data.Stats(pb.StatsRequest(), metadata=md(TOKEN_OPS))
    assert [e.instance_id for e in seen_a.engines] == ["host-a"]
    assert sorted(e.instance_id for e in seen_ops.engines) == ["host-a", "secret-host-b"]


async def test_a_reload_that_would_empty_the_tokens_file_is_refused(daemon_factory: Any,
                                                                     tmp_path: Any) -> None:
    """A tokens file with no token means no authentication (quotas alone): a
    reload that revokes every token must not let TCP callers in without one."""
    d, path = await with_tokens(daemon_factory, tmp_path)
    path.write_text("[tokens]\n")
    d.reload(d.config)
    assert len(d.tokens.grants) == 2   # the table in force stays
    async with grpc.aio.insecure_channel(f"127.0.0.1:{d.port}") as ch:
        await expect(grpc.StatusCode.UNAUTHENTICATED, pb_grpc.KVKeeperStub(ch).RegisterSession(
            pb.RegisterSessionRequest(instance_id="x", namespace=pb.NamespaceDescriptor(
                model_id="model-z", block_tokens=32, block_bytes=4096))), "token")


async def test_a_namespace_id_reveals_nothing_to_a_token_that_does_not_cover_it(
        daemon_factory: Any, tmp_path: Any) -> None:
    d, path = await with_tokens(daemon_factory, tmp_path)
    async with grpc.aio.insecure_channel(f"127.0.0.1:{d.port}") as ch:
        data, res = pb_grpc.KVKeeperStub(ch), rpb_grpc.KVKeeperResidencyStub(ch)
        other = (await data.RegisterSession(pb.RegisterSessionRequest(
            instance_id="o", namespace=pb.NamespaceDescriptor(
                model_id="secret-model-b", block_tokens=32, block_bytes=4096)),
            metadata=md(TOKEN_OPS))).namespace_id
        answers = []
        for ns_id in (other, bytes(16)):   # another tenant's, and one nobody has
            with pytest.raises(grpc.aio.AioRpcError) as e:
                await res.Locate(rpb.LocateRequest(namespace_id=ns_id, keys=[bytes(32)]),
                                 metadata=md(TOKEN_A))
            answers.append((e.value.code(), e.value.details()))
        assert answers[0] == answers[1] and answers[0][0] == grpc.StatusCode.PERMISSION_DENIED
        assert "secret-model-b" not in answers[0][1]
        # A token that covers every model still learns of an unknown id (an empty answer).
        assert (await res.Locate(rpb.LocateRequest(namespace_id=bytes(16), keys=[bytes(32)]),
                                 metadata=md(TOKEN_OPS))).stored == 0
        # A refused WatchEvents turns nothing on.
        with pytest.raises(grpc.aio.AioRpcError):
            async for _ in res.WatchEvents(rpb.WatchEventsRequest(
                    resume=True, epoch=d.ledger.residency.log.epoch, after_seq=999),
                    metadata=md(TOKEN_OPS)):
                pass
        assert not d.ledger.residency.log.watched


async def test_an_engine_book_beyond_any_gpu_is_refused(daemon: Any, stub: Any) -> None:
    from kvkeeper.server.ledger.residency import MAX_CAPACITY_BLOCKS

    sid = await register(stub)
    async with grpc.aio.insecure_channel(f"unix:{daemon.socket_path}") as ch:
        res = rpb_grpc.KVKeeperResidencyStub(ch)
        await expect(INVALID, res.ReportResidency(rpb.ReportResidencyRequest(
            session_id=sid, capacity_blocks=MAX_CAPACITY_BLOCKS + 1)), "capacity_blocks")
        assert not daemon.ledger.residency.books
        assert MAX_CAPACITY_BLOCKS <= 1 << 22
