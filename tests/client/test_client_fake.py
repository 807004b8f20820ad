"""The client's byte paths (shared memory and streams), checksums, limits and
the blocking wrapper, against an in-memory fake daemon that follows the proto.

The fake runs on its own event loop thread so the blocking Client can be
tested from the test's thread. Tests against the real daemon live elsewhere.
"""
import asyncio
import os
import struct
import threading
import zlib

import grpc
import numpy as np
import pytest

from kvkeeper.client import (AsyncClient, ChecksumError, Client, KVKeeperClientError,
                             NotFoundError, crc32, xxh3_64)
from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

BB = 3000  # block bytes: not a multiple of the chunk sizes below
NS = {"model_id": "m", "dtype": "bfloat16", "block_tokens": 16, "block_bytes": BB}


def key(i):
    return i.to_bytes(4, "big") * 8


def block(i):
    return bytes((i * 7 + j) % 251 for j in range(BB))


class FakeDaemon(pb_grpc.KVKeeperServicer):
    """Enough of the daemon for the client: one namespace, no eviction."""

    def __init__(self, arena_path=None, max_keys=4, chunk=1000, max_message_bytes=0):
        self.max_keys, self.chunk, self.max_message_bytes = max_keys, chunk, max_message_bytes
        self.sessions, self.blocks, self.leases, self.res = set(), {}, {}, {}
        self.next_id = 1
        self.corrupt = set()     # keys whose bytes get flipped on load
        self.write_sizes = []    # data sizes of WriteChunk messages
        self.released = []
        self.fail_commit = None  # details of an INTERNAL error CommitSave answers
        self.stream_fault = None  # LoadStream misbehaves: "gap", "beyond", "short", "skip"
        self.arena = None
        if arena_path:
            pages = 64
            self.arena_id = os.urandom(16)
            with open(arena_path, "wb") as f:
                f.write(struct.pack("<8s16sQQQQ", b"KVKARENA", self.arena_id, BB, pages, 4096, 1))
                f.truncate(4096 + pages * BB)
            self.arena = pb.ShmArena(path=str(arena_path), size_bytes=4096 + pages * BB,
                                     page_bytes=BB, arena_id=self.arena_id)
            self.fd = os.open(arena_path, os.O_RDWR)
            self.pages, self.pages_n = 0, pages

    def _id(self):
        self.next_id += 1
        return self.next_id

    def _extents(self):
        off = 4096 + (self.pages % self.pages_n) * BB
        self.pages += 1
        return [pb.Extent(offset=off, length=1000), pb.Extent(offset=off + 1000, length=BB - 1000)]

    async def _session(self, sid, context):
        if sid not in self.sessions:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown session {sid}")

    async def RegisterSession(self, request, context):
        sid = f"s{self._id()}"
        self.sessions.add(sid)
        return pb.RegisterSessionResponse(session_id=sid, lease_ttl_seconds=30, key_bytes=32,
                                          max_keys_per_call=self.max_keys, arena=self.arena,
                                          max_message_bytes=self.max_message_bytes)

    async def Heartbeat(self, request, context):
        await self._session(request.session_id, context)
        return pb.HeartbeatResponse(lease_ttl_seconds=30)

    async def CloseSession(self, request, context):
        self.sessions.discard(request.session_id)
        return pb.CloseSessionResponse()

    async def Match(self, request, context):
        await self._session(request.session_id, context)
        if len(request.keys) > self.max_keys:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "too many keys")
        n = 0
        while n < len(request.keys) and request.keys[n] in self.blocks:
            n += 1
        lease = 0
        if request.lease and n:
            lease = self._id()
            self.leases[lease] = (request.session_id, list(request.keys[:n]))
        return pb.MatchResponse(matched=n, tiers=[pb.TIER_HOST] * n, lease_id=lease)

    def _lease_blocks(self, lease_id):
        for k in self.leases[lease_id][1]:
            data, algo, csum = self.blocks[k]
            if k in self.corrupt:
                data = bytes([data[0] ^ 1]) + data[1:]
            yield data, algo, csum, k

    async def Load(self, request, context):
        await self._session(request.session_id, context)
        if request.lease_id not in self.leases:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown lease {request.lease_id}")
        refs = []
        for data, algo, csum, k in self._lease_blocks(request.lease_id):
            ext = self._extents()
            os.pwrite(self.fd, data[:1000], ext[0].offset)
            os.pwrite(self.fd, data[1000:], ext[1].offset)
            refs.append(pb.BlockRef(key=k, extents=ext, checksum_algo=algo, checksum=csum))
        return pb.LoadResponse(blocks=refs)

    async def LoadStream(self, request, context):
        await self._session(request.session_id, context)
        if request.lease_id not in self.leases:
            await context.abort(grpc.StatusCode.NOT_FOUND, f"unknown lease {request.lease_id}")
        fault = self.stream_fault
        for i, (data, algo, csum, _) in enumerate(self._lease_blocks(request.lease_id)):
            if fault == "skip" and i == 1:
                continue
            for off in range(0, BB, self.chunk):
                if fault == "gap" and i == 1 and off == self.chunk:
                    continue
                end = off + self.chunk + (1 if fault == "beyond" and off + self.chunk >= BB else 0)
                if fault == "short" and i == 1 and end >= BB:
                    end = BB - 1
                ch = pb.BlockChunk(index=i, offset=off, data=(data + b"!")[off:end])
                if off == 0:
                    ch.checksum_algo, ch.checksum = algo, csum
                yield ch

    async def ReserveSave(self, request, context):
        await self._session(request.session_id, context)
        if len(request.keys) > self.max_keys:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "too many keys")
        inflight = {k for r in self.res.values() for k in r["keys"]}
        slots, rsv = [], {}
        for i, k in enumerate(request.keys):
            if k in self.blocks:
                slots.append(pb.SaveSlot(status=pb.SLOT_PRESENT))
            elif k in inflight:
                slots.append(pb.SaveSlot(status=pb.SLOT_IN_FLIGHT))
            else:
                ext = self._extents() if request.transport == pb.TRANSPORT_SHM else []
                rsv[i] = (k, ext, bytearray(BB))
                slots.append(pb.SaveSlot(status=pb.SLOT_RESERVED, extents=ext))
        rid = 0
        if rsv:
            rid = self._id()
            self.res[rid] = {"keys": [v[0] for v in rsv.values()], "slots": rsv,
                             "n": len(request.keys)}
        return pb.ReserveSaveResponse(reservation_id=rid, slots=slots, expires_in_seconds=10)

    async def WriteBlocks(self, request_iterator, context):
        rid, total = None, 0
        async for ch in request_iterator:
            rid = rid or ch.reservation_id
            self.write_sizes.append(len(ch.data))
            if rid not in self.res or ch.index not in self.res[rid]["slots"]:
                await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "index not reserved")
            buf = self.res[rid]["slots"][ch.index][2]
            buf[ch.offset:ch.offset + len(ch.data)] = ch.data
            total += len(ch.data)
        return pb.WriteBlocksResponse(bytes_written=total)

    async def CommitSave(self, request, context):
        if self.fail_commit:
            await context.abort(grpc.StatusCode.INTERNAL, self.fail_commit)
        r = self.res.pop(request.reservation_id, None)
        if r is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown reservation")
        if request.checksums and len(request.checksums) != r["n"]:
            await context.abort(grpc.StatusCode.INVALID_ARGUMENT, "checksum count")
        for i, (k, ext, buf) in r["slots"].items():
            data = b"".join(os.pread(self.fd, e.length, e.offset) for e in ext) if ext else bytes(buf)
            csum = request.checksums[i] if request.checksums else 0
            self.blocks[k] = (data, request.checksum_algo, csum)
        return pb.CommitSaveResponse(committed=len(r["slots"]))

    async def AbortSave(self, request, context):
        self.res.pop(request.reservation_id, None)
        return pb.AbortSaveResponse()

    async def Release(self, request, context):
        await self._session(request.session_id, context)
        if self.leases.pop(request.lease_id, None) is None:
            await context.abort(grpc.StatusCode.NOT_FOUND, "unknown lease")
        self.released.append((request.lease_id, request.discard))
        return pb.ReleaseResponse()

    async def Stats(self, request, context):
        return pb.StatsResponse(version="fake", sessions=len(self.sessions))


class Running:
    """A fake daemon served on its own loop thread."""

    def __init__(self, fake):
        self.fake = fake
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.url = f"127.0.0.1:{self._do(self._start())}"

    def _do(self, coro):
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _start(self):
        from grpc_health.v1 import health, health_pb2_grpc
        self.server = grpc.aio.server()
        pb_grpc.add_KVKeeperServicer_to_server(self.fake, self.server)
        health_pb2_grpc.add_HealthServicer_to_server(health.aio.HealthServicer(), self.server)
        port = self.server.add_insecure_port("127.0.0.1:0")
        await self.server.start()
        return port

    def stop(self):
        self._do(self.server.stop(None))
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join(5)


@pytest.fixture(params=["stream", "shm"])
def fake_daemon(request, tmp_path):
    shm = request.param == "shm"
    d = Running(FakeDaemon(arena_path=tmp_path / "arena" if shm else None))
    d.transport = request.param
    yield d
    d.stop()


async def test_save_match_load_roundtrip(fake_daemon):
    keys, blocks = [key(i) for i in range(10)], [block(i) for i in range(10)]
    async with await AsyncClient.connect(fake_daemon.url, NS, transport=fake_daemon.transport) as c:
        assert c.transport == fake_daemon.transport and c.max_keys_per_call == 4
        r = await c.save(keys[:6], blocks[:6])  # split into rounds of max_keys_per_call
        assert (r.reserved, r.present, r.in_flight, r.committed) == (6, 0, 0, 6)
        r = await c.save(keys, [bytearray(b) for b in blocks])
        assert (r.reserved, r.present, r.committed) == (4, 6, 4)
        stored = fake_daemon.fake.blocks
        assert all(stored[k][0] == b and stored[k][1] == pb.CHECKSUM_XXH3_64   # the default
                   and stored[k][2] == xxh3_64(b) for k, b in zip(keys, blocks))

        m = await c.match(keys + [key(99)])
        assert (m.matched, m.lease_id, len(m.tiers)) == (10, None, 10)
        m = await c.match(keys, lease=True)  # one lease: at most max_keys_per_call keys
        assert m.matched == 4 and m.lease_id
        assert await c.load(m.lease_id) == blocks[:4]
        outs = [np.zeros(BB, np.uint8) for _ in range(4)]
        await c.load_into(m.lease_id, outs)
        assert [o.tobytes() for o in outs] == blocks[:4]
        with pytest.raises(ValueError, match="buffers"):
            await c.load_into(m.lease_id, outs[:3])
        await c.release(m.lease_id, discard=True)
        assert fake_daemon.fake.released == [(m.lease_id, True)]
        with pytest.raises(NotFoundError):
            await c.release(m.lease_id)


async def test_checksum_mismatch_lists_bad_blocks(fake_daemon):
    keys, blocks = [key(i) for i in range(3)], [block(i) for i in range(3)]
    async with await AsyncClient.connect(fake_daemon.url, NS, transport=fake_daemon.transport) as c:
        await c.save(keys, blocks)
        fake_daemon.fake.corrupt.add(keys[1])
        m = await c.match(keys, lease=True)
        with pytest.raises(ChecksumError) as info:
            await c.load(m.lease_id)
        assert info.value.bad_indices == [1]
        outs = [bytearray(BB + 10) for _ in range(3)]  # larger buffers are fine
        with pytest.raises(ChecksumError):
            await c.load_into(m.lease_id, outs)
        assert bytes(outs[2][:BB]) == blocks[2]
    async with await AsyncClient.connect(fake_daemon.url, NS, transport=fake_daemon.transport,
                                         checksum="none") as c:
        # (the fake does not check lease ownership) with checksum="none" nothing is verified
        assert len(await c.load(m.lease_id)) == 3
        await c.save([key(50)], [block(50)])
        assert fake_daemon.fake.blocks[key(50)][1:] == (pb.CHECKSUM_NONE, 0)


async def test_blocks_verify_with_the_algorithm_they_were_stored_with(fake_daemon):
    """A block saved by an old-config client (CRC32) loads and verifies in a
    client that saves XXH3-64, and the other way round; a corrupted block is
    refused whichever algorithm it was stored with."""
    url, tr = fake_daemon.url, fake_daemon.transport
    old_keys, new_keys = [key(i) for i in range(3)], [key(10 + i) for i in range(3)]
    old_blocks, new_blocks = [block(i) for i in range(3)], [block(10 + i) for i in range(3)]
    async with await AsyncClient.connect(url, NS, transport=tr, checksum="crc32") as old:
        await old.save(old_keys, old_blocks)
    stored = fake_daemon.fake.blocks
    assert [stored[k][1:] for k in old_keys] == [(pb.CHECKSUM_CRC32, crc32(b))
                                                 for b in old_blocks]
    async with await AsyncClient.connect(url, NS, transport=tr) as new:
        await new.save(new_keys, new_blocks)
        assert all(stored[k][1] == pb.CHECKSUM_XXH3_64 for k in new_keys)
        m = await new.match(old_keys, lease=True)
        assert await new.load(m.lease_id) == old_blocks
        for k in (old_keys[2], new_keys[1]):
            fake_daemon.fake.corrupt.add(k)
        for keys, bad in ((old_keys, [2]), (new_keys, [1])):
            m = await new.match(keys, lease=True)
            with pytest.raises(ChecksumError) as info:
                await new.load(m.lease_id)
            assert info.value.bad_indices == bad
            outs = [np.zeros(BB, np.uint8) for _ in range(3)]
            with pytest.raises(ChecksumError) as info:
                await new.load_into(m.lease_id, outs)
            assert info.value.bad_indices == bad
    async with await AsyncClient.connect(url, NS, transport=tr, checksum="crc32") as old:
        m = await old.match(new_keys, lease=True)
        with pytest.raises(ChecksumError) as info:   # a CRC32 client checks XXH3 blocks too
            await old.load(m.lease_id)
        assert info.value.bad_indices == [1]
    with pytest.raises(ValueError, match="xxh3"):
        await AsyncClient.connect(url, NS, transport=tr, checksum="md5")


async def test_validation_before_sending(fake_daemon):
    async with await AsyncClient.connect(fake_daemon.url, NS, transport=fake_daemon.transport) as c:
        with pytest.raises(ValueError, match="2 keys but 1 blocks"):
            await c.save([key(1), key(2)], [block(1)])
        with pytest.raises(ValueError, match="block_bytes"):
            await c.save([key(1)], [b"short"])
        with pytest.raises(ValueError, match="key 0 has 3 bytes"):
            await c.match([b"abc"])
        with pytest.raises(ValueError, match="read-only"):
            await c.load_into(1, [bytes(BB)])
        assert (await c.match([])).matched == 0
    assert fake_daemon.fake.res == {}


async def test_failure_after_reserve_aborts(fake_daemon):
    async with await AsyncClient.connect(fake_daemon.url, NS, transport=fake_daemon.transport) as c:
        fake_daemon.fake.fail_commit = "disk on fire"
        with pytest.raises(KVKeeperClientError, match="disk on fire") as info:
            await c.save([key(1)], [block(1)])
        assert info.value.code == grpc.StatusCode.INTERNAL
        fake_daemon.fake.fail_commit = None
        assert fake_daemon.fake.res == {}  # aborted
        assert (await c.save([key(1)], [block(1)])).committed == 1


async def test_stream_chunks_respect_limits():
    d = Running(FakeDaemon(max_keys=1000, max_message_bytes=6000))
    try:
        big = dict(NS, block_bytes=3 << 20)
        async with await AsyncClient.connect(d.url, big) as c:
            data = os.urandom(3 << 20)
            assert (await c.save([key(1)], [data])).committed == 1
            assert max(d.fake.write_sizes) <= 4096 and sum(d.fake.write_sizes) == 3 << 20
        d.fake.write_sizes.clear()
        d.fake.max_message_bytes = 0
        async with await AsyncClient.connect(d.url, big) as c:
            await c.save([key(2)], [np.frombuffer(data, np.float32)])  # any buffer
            assert max(d.fake.write_sizes) == 1 << 20
            assert d.fake.blocks[key(2)][2] == xxh3_64(data)
    finally:
        d.stop()


async def test_shm_falls_back_to_stream_when_arena_changes(tmp_path):
    d = Running(FakeDaemon(arena_path=tmp_path / "arena"))
    try:
        async with await AsyncClient.connect(d.url, NS) as c:
            assert c.transport == "shm"
            await c.save([key(1)], [block(1)])
            os.replace(tmp_path / "arena", tmp_path / "moved")  # the file is not the daemon's
            m = await c.match([key(1)], lease=True)
            assert await c.load(m.lease_id) == [block(1)]
            assert c.transport == "stream"
            assert (await c.save([key(2)], [block(2)])).committed == 1
    finally:
        d.stop()


def test_blocking_client_from_threads(fake_daemon):
    with Client.connect(fake_daemon.url, NS, transport=fake_daemon.transport) as c:
        assert c.health() == "SERVING"
        assert c.stats().version == "fake"

        errors = []

        def work(t):
            try:
                _work(t)
            except BaseException as e:  # surfaced below
                errors.append(e)

        def _work(t):
            keys = [key(100 * t + i) for i in range(5)]
            blocks = [block(100 * t + i) for i in range(5)]
            assert c.save(keys, blocks).committed == 5
            m = c.match(keys, lease=True)
            assert c.load(m.lease_id) == blocks[:4]
            c.release(m.lease_id)

        threads = [threading.Thread(target=work, args=(t,)) for t in range(8)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(30)
        assert not any(t.is_alive() for t in threads)
        assert not errors and len(fake_daemon.fake.blocks) == 40
    assert c.closed
    c.close()
    with pytest.raises(RuntimeError):
        c.stats()


async def test_match_blocks_from_a_daemon_that_ignores_them(fake_daemon):
    # The fake predates MatchRequest.blocks: a shm client then asks Load itself.
    keys, blocks = [key(i) for i in range(3)], [block(i) for i in range(3)]
    async with await AsyncClient.connect(fake_daemon.url, NS, transport=fake_daemon.transport) as c:
        await c.save(keys, blocks)
        m = await c.match(keys, lease=True, blocks=True)
        assert m.matched == 3 and m.lease_id
        views = c.arena_views(m.blocks)
        if fake_daemon.transport == "shm":
            assert [r.key for r in m.blocks] == keys
            assert [b"".join(vs) for vs in views] == blocks
        else:
            assert m.blocks == [] and views is None
        await c.release(m.lease_id)


class WrongRefs(FakeDaemon):
    """Answers Match(blocks) with one ref too few."""

    async def Match(self, request, context):
        resp = await super().Match(request, context)
        if request.blocks and resp.lease_id:
            resp.blocks.add(key=request.keys[0], extents=self._extents())
        return resp


async def test_match_blocks_mismatch_releases_the_lease(tmp_path):
    d = Running(WrongRefs(arena_path=tmp_path / "arena"))
    try:
        async with await AsyncClient.connect(d.url, NS) as c:
            await c.save([key(1), key(2)], [block(1), block(2)])
            with pytest.raises(KVKeeperClientError, match="2 blocks came with 1 block refs"):
                await c.match([key(1), key(2)], lease=True, blocks=True)
            assert d.fake.leases == {} and len(d.fake.released) == 1
    finally:
        d.stop()


def test_blocking_client_match_blocks(fake_daemon):
    with Client.connect(fake_daemon.url, NS, transport=fake_daemon.transport) as c:
        c.save([key(7)], [block(7)])
        m = c.match([key(7)], lease=True, blocks=True)
        views = c.arena_views(m.blocks)
        assert (views is None) == (fake_daemon.transport == "stream")
        if views is not None:
            assert b"".join(views[0]) == block(7)
        with pytest.raises(ValueError, match="lease=True"):
            c.match([key(7)], blocks=True)
        c.release(m.lease_id)


def _chunked(chunks):
    """(blocks reassembled from wire.Chunks, the chunks' (index, offset, algo, checksum))."""
    parts, heads = {}, []
    for ch in chunks:
        assert isinstance(ch.data, memoryview) and ch.data.readonly
        parts.setdefault(ch.index, bytearray())[ch.offset:] = ch.data
        heads.append((ch.index, ch.offset, ch.checksum_algo, ch.checksum))
    return [bytes(parts[i]) for i in sorted(parts)], heads


def _expected_heads(blocks):
    return [(i, off, pb.CHECKSUM_XXH3_64 if off == 0 else 0, xxh3_64(b) if off == 0 else 0)
            for i, b in enumerate(blocks) for off in range(0, BB, 1000)]


@pytest.fixture
def stream_daemon():
    d = Running(FakeDaemon())
    yield d
    d.stop()


async def test_load_chunks_yields_what_the_daemon_sent(stream_daemon):
    """The fake daemon serializes with protobuf; the client parses by hand."""
    keys, blocks = [key(i) for i in range(3)], [block(i) for i in range(3)]
    async with await AsyncClient.connect(stream_daemon.url, NS, transport="stream") as c:
        await c.save(keys, blocks)
        m = await c.match(keys, lease=True)
        got = [ch async for ch in c.load_chunks(m.lease_id)]
        assert _chunked(got) == (blocks, _expected_heads(blocks))
        with pytest.raises(ValueError, match="more blocks than the 2 buffers"):
            [ch async for ch in c.load_chunks(m.lease_id, max_blocks=2)]
        with pytest.raises(NotFoundError):
            [ch async for ch in c.load_chunks(4242)]


def test_blocking_load_chunks_reads_on_the_calling_thread(stream_daemon):
    keys, blocks = [key(i) for i in range(3)], [block(i) for i in range(3)]
    with Client.connect(stream_daemon.url, NS, transport="stream") as c:
        c.save(keys, blocks)
        m = c.match(keys, lease=True)
        assert _chunked(c.load_chunks(m.lease_id)) == (blocks, _expected_heads(blocks))
        it = c.load_chunks(m.lease_id)
        next(it)
        it.close()   # stopping early cancels the stream; the client goes on working
        assert _chunked(c.load_chunks(m.lease_id))[0] == blocks
        with pytest.raises(NotFoundError):
            list(c.load_chunks(4242))
    with pytest.raises(RuntimeError, match="closed"):
        list(c.load_chunks(m.lease_id))


@pytest.mark.parametrize("fault,message", [
    ("gap", "gap or overlap in block 1"), ("beyond", "beyond block_bytes"),
    ("short", "2999 of 3000 bytes of block 1"), ("skip", r"block indices \[0, 2\]")])
async def test_a_stream_that_breaks_the_protocol_fails_every_load(stream_daemon, fault, message):
    keys, blocks = [key(i) for i in range(3)], [block(i) for i in range(3)]
    async with await AsyncClient.connect(stream_daemon.url, NS, transport="stream") as c:
        await c.save(keys, blocks)
        m = await c.match(keys, lease=True)
        stream_daemon.fake.stream_fault = fault
        for load in (lambda: c.load(m.lease_id),
                     lambda: c.load_into(m.lease_id, [bytearray(BB) for _ in range(3)]),
                     lambda: _drain(c.load_chunks(m.lease_id))):
            with pytest.raises(KVKeeperClientError, match=message) as info:
                await load()
            assert info.value.code == grpc.StatusCode.INTERNAL
    with Client.connect(stream_daemon.url, NS, transport="stream") as b:
        m = b.match(keys, lease=True)
        with pytest.raises(KVKeeperClientError, match=message):
            list(b.load_chunks(m.lease_id))


async def _drain(chunks):
    return [ch async for ch in chunks]
