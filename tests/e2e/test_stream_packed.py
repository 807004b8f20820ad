"""Streamed loads of small blocks against a real daemon: the client asks for
packed chunks (several whole blocks per message) and hands them on one block
at a time, each checked against its own checksum."""
from __future__ import annotations

import asyncio
from typing import Any

import pytest
from test_client_daemon import BLOCK, blocks, keys, ns

from kvkeeper.client import AsyncClient, ChecksumError, Client


def _corrupt(daemon: Any, namespace_id: bytes, key: bytes, at: int) -> None:
    blk = daemon.ledger.block(namespace_id, key)
    off, _ = daemon.arena.extents(blk.pages, blk.ns.pages_per_block, BLOCK)[0]
    with open(daemon.arena.path, "r+b") as f:
        f.seek(off + at)
        byte = f.read(1)
        f.seek(off + at)
        f.write(bytes([byte[0] ^ 0xFF]))


@pytest.mark.parametrize("checksum", ["xxh3", "crc32"])
async def test_a_corrupt_block_inside_a_packed_chunk_is_named_not_served(
        daemon: Any, checksum: str) -> None:
    daemon.servicer.stream_pack_bytes = 4 * BLOCK   # four blocks per message
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns(), transport="stream",
                                  checksum=checksum)
    try:
        ks, bs = keys(6), blocks(6)
        await c.save(ks, bs)
        m = await c.match(ks, lease=True)
        assert await c.load(m.lease_id) == bs
        _corrupt(daemon, c.namespace_id, ks[2], 99)
        with pytest.raises(ChecksumError) as info:
            await c.load_into(m.lease_id, [bytearray(BLOCK) for _ in range(6)])
        assert info.value.bad_indices == [2]
        await c.release(m.lease_id, discard_indices=[2])
        daemon.ledger.check_invariants()
    finally:
        await c.close()


async def test_load_chunks_hands_on_one_block_per_chunk(daemon: Any) -> None:
    daemon.servicer.stream_pack_bytes = 3 * BLOCK
    url = f"unix://{daemon.socket_path}"
    ks, bs = keys(7), blocks(7)
    w = await AsyncClient.connect(url, ns(), transport="stream")
    try:
        await w.save(ks, bs)
    finally:
        await w.close()

    def read() -> list:
        c = Client.connect(url, ns(), transport="stream")
        try:
            m = c.match(ks, lease=True)
            got = [(ch.index, ch.offset, bytes(ch.data), ch.checksum_algo, ch.checksum)
                   for ch in c.load_chunks(m.lease_id)]
            c.release(m.lease_id)
            return got
        finally:
            c.close()

    got = await asyncio.to_thread(read)
    assert [(i, o) for i, o, *_ in got] == [(i, 0) for i in range(7)]
    assert [d for _, _, d, _, _ in got] == bs
    assert all(algo and s for *_, algo, s in got)   # every block carries its own checksum


async def test_stream_matching_matches_and_streams_in_one_call(daemon: Any) -> None:
    url = f"unix://{daemon.socket_path}"
    ks, bs = keys(5), blocks(5)

    def run() -> tuple:
        c = Client.connect(url, ns(), transport="stream")
        try:
            c.save(ks, bs)
            ks_ = c.stream_matching(ks + keys(1, salt=7))
            got = [(ch.index, bytes(ch.data)) for ch in ks_.chunks]
            leases = daemon.ledger.leases.get(ks_.lease_id)
            c.release(ks_.lease_id)
            none = c.stream_matching(keys(2, salt=8))
            too_many = c.stream_matching(keys(c.max_keys_per_call + 1, salt=9))
            return ks_.matched, got, leases, none, too_many
        finally:
            c.close()

    matched, got, lease, none, too_many = await asyncio.to_thread(run)
    assert matched == 5 and got == list(enumerate(bs))
    assert lease is not None and lease.report_use
    assert (none.lease_id, none.matched, list(none.chunks)) == (0, 0, [])
    assert too_many is None    # more than one call takes: match and load_chunks instead
    assert not daemon.ledger.leases
    daemon.ledger.check_invariants()


async def test_streamed_saves_pack_the_runs_between_present_blocks(daemon: Any) -> None:
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns(), transport="stream")
    try:
        ks, bs = keys(7), blocks(7)
        await c.save([ks[2], ks[5]], [bs[2], bs[5]])
        r = await c.save(ks, bs)   # reserved: 0, 1, 3, 4, 6; packed as [0, 1], [3, 4], [6]
        assert (r.committed, r.present) == (5, 2)
        m = await c.match(ks, lease=True)
        assert await c.load(m.lease_id) == bs
        await c.release(m.lease_id)
        daemon.ledger.check_invariants()
    finally:
        await c.close()
