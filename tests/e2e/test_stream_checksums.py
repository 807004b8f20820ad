"""Checksums taken in passing on the stream path (client.checksum.StreamSums):
a save sends the checksum of exactly the bytes saved, and a load names
exactly the damaged blocks, whether blocks go whole, packed or in pieces."""
from __future__ import annotations

from typing import Any

import pytest
from test_client_daemon import BLOCK, blocks, keys, ns

from kvkeeper.client import AsyncClient, ChecksumError
from kvkeeper.client import saves
from kvkeeper.client.checksum import ALGOS, NAMES


def _flip(daemon: Any, namespace_id: bytes, key: bytes, at: int) -> None:
    blk = daemon.ledger.block(namespace_id, key)
    for off, n in daemon.arena.extents(blk.pages, blk.ns.pages_per_block, BLOCK):
        if at < n:
            daemon.arena.view(off + at, 1)[0] ^= 0x10
            return
        at -= n


@pytest.mark.parametrize("checksum", ["xxh3", "crc32"])
@pytest.mark.parametrize("piece", [1000, 4096, 0], ids=["pieces", "pages", "whole"])
async def test_stream_save_and_load_check_every_block(daemon: Any, monkeypatch: Any,
                                                      checksum: str, piece: int) -> None:
    if piece:   # blocks cross several chunks each way
        monkeypatch.setattr(saves, "WRITE_CHUNK_BYTES", piece)
        daemon.servicer.stream_chunk_bytes = piece
        daemon.servicer.stream_pack_bytes = 0
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns(), transport="stream",
                                  checksum=checksum)
    algo = NAMES[checksum]
    try:
        ks, bs = keys(6), blocks(6, seed=7)
        assert (await c.save(ks, bs)).committed == 6
        for k, b in zip(ks, bs):
            assert daemon.ledger.block(c.namespace_id, k).checksum == (algo, ALGOS[algo](b))
        # Damage in block 1's first piece, block 4's last byte.
        _flip(daemon, c.namespace_id, ks[1], 3)
        _flip(daemon, c.namespace_id, ks[4], BLOCK - 1)
        m = await c.match(ks, lease=True)
        outs = [bytearray(BLOCK) for _ in range(6)]
        with pytest.raises(ChecksumError) as info:
            await c.load_into(m.lease_id, outs)
        assert info.value.bad_indices == [1, 4]
        assert [bytes(o) for i, o in enumerate(outs) if i not in (1, 4)] == \
            [b for i, b in enumerate(bs) if i not in (1, 4)]
        with pytest.raises(ChecksumError) as info:
            await c.load(m.lease_id)
        assert info.value.bad_indices == [1, 4]
        await c.release(m.lease_id, discard_indices=[1, 4])
        daemon.ledger.check_invariants()
    finally:
        await c.close()
