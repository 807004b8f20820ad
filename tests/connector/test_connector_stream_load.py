"""load.stream.load_streamed with a stand-in client (torch, no daemon, no
engine): blocks land in the KV cache from whole or split chunks in any
order, each is checked there, and a stream that fails or comes short loads
nothing."""
from __future__ import annotations

import random
import zlib
from typing import Any, Iterator, List

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (it comes with vllm)")

from test_connector_blocks import LAYOUT, kv_tensors  # noqa: E402

from kvkeeper.client.checksum import checksum  # noqa: E402
from kvkeeper.client.wire import Chunk  # noqa: E402
from kvkeeper.connector.blocks import BlockCodec  # noqa: E402
from kvkeeper.connector.load.stream import load_streamed  # noqa: E402
from kvkeeper.v1 import kvkeeper_pb2 as pb  # noqa: E402

NUM_BLOCKS = 8
BB = LAYOUT.block_bytes


def stored(n: int, seed: int) -> List[bytes]:
    """What the daemon holds: the block bytes of another KV cache's blocks 0..n-1."""
    codec = BlockCodec(LAYOUT, kv_tensors(LAYOUT, NUM_BLOCKS, seed=seed), NUM_BLOCKS)
    rows = codec.new_rows(n)
    codec.gather(list(range(n)), rows)
    return [bytes(rows[i].numpy()) for i in range(n)]


class FakeClient:
    """load_chunks as the client yields it: chunks of `chunk` bytes, in the
    given order, checksum on each block's first chunk; `fail_after` raises
    mid-stream like a broken connection."""

    def __init__(self, blocks: List[bytes], chunk: int = BB, shuffle: bool = False,
                 fail_after: int = -1, algo: int = pb.CHECKSUM_CRC32) -> None:
        self.blocks, self.chunk, self.shuffle, self.fail_after = blocks, chunk, shuffle, fail_after
        self.algo = algo

    def load_chunks(self, lease_id: int) -> Iterator[Chunk]:
        out = []
        for i, b in enumerate(self.blocks):
            for off in range(0, BB, self.chunk):
                first = off == 0
                out.append(Chunk(i, off, memoryview(b[off:off + self.chunk]).toreadonly(),
                                 self.algo if first else 0,
                                 checksum(self.algo, b) if first else 0))
        if self.shuffle:
            random.Random(7).shuffle(out)
        for k, ch in enumerate(out):
            if k == self.fail_after:
                raise ConnectionError("stream broke")
            yield ch


def crc_check(codec: BlockCodec) -> Any:
    def check(block_id: int, expected: Any, source: Any) -> bool:
        algo, want = expected
        landed = codec.block_checksum(block_id, algo)
        assert checksum(algo, source.numpy()) == landed, "the source is what was copied"
        return landed == want
    return check


@pytest.mark.parametrize("algo", [pb.CHECKSUM_CRC32, pb.CHECKSUM_XXH3_64])
@pytest.mark.parametrize("chunk,shuffle", [(BB, False), (BB, True), (1000, False), (1000, True)])
def test_streamed_blocks_land_in_the_kv_cache(chunk: int, shuffle: bool, algo: int) -> None:
    data = stored(3, seed=1)
    kv = kv_tensors(LAYOUT, NUM_BLOCKS, seed=2)
    codec = BlockCodec(LAYOUT, kv, NUM_BLOCKS)
    good, bad = load_streamed(FakeClient(data, chunk, shuffle, algo=algo), codec, 1, [5, 0, 6],
                              crc_check(codec))
    assert (good, bad) == (3, [])
    rows = codec.new_rows(3)
    codec.gather([5, 0, 6], rows)
    assert [bytes(rows[i].numpy()) for i in range(3)] == data


def test_a_block_that_fails_its_check_is_returned() -> None:
    data = stored(3, seed=1)
    data[1] = data[1][:100] + bytes([data[1][100] ^ 1]) + data[1][101:]   # after the checksum
    cl = FakeClient(data)
    codec = BlockCodec(LAYOUT, kv_tensors(LAYOUT, NUM_BLOCKS, seed=2), NUM_BLOCKS)
    sums = [zlib.crc32(b) for b in stored(3, seed=1)]
    checked: List[int] = []

    def check(block_id: int, expected: Any, source: Any) -> bool:
        checked.append(block_id)
        return codec.block_checksum(block_id, pb.CHECKSUM_CRC32) == sums[[2, 3, 4].index(block_id)]

    assert load_streamed(cl, codec, 1, [2, 3, 4], check) == (1, [1])
    assert checked == [2, 3, 4]


def test_later_blocks_of_the_lease_are_not_copied() -> None:
    data = stored(3, seed=1)
    kv = kv_tensors(LAYOUT, NUM_BLOCKS, seed=2)
    before = {n: t.clone() for n, t in kv.items()}
    codec = BlockCodec(LAYOUT, kv, NUM_BLOCKS)
    assert load_streamed(FakeClient(data), codec, 1, [4, 5], crc_check(codec)) == (2, [])
    assert all(torch.equal(kv[n][b], before[n][b]) for n in kv for b in (0, 1, 2, 3, 6, 7))


def test_a_broken_stream_raises() -> None:
    codec = BlockCodec(LAYOUT, kv_tensors(LAYOUT, NUM_BLOCKS, seed=2), NUM_BLOCKS)
    with pytest.raises(ConnectionError):
        load_streamed(FakeClient(stored(3, seed=1), fail_after=2), codec, 1, [0, 1, 2],
                      crc_check(codec))


def test_a_stream_with_fewer_blocks_than_asked_raises() -> None:
    codec = BlockCodec(LAYOUT, kv_tensors(LAYOUT, NUM_BLOCKS, seed=2), NUM_BLOCKS)
    with pytest.raises(RuntimeError, match="2 whole blocks of the 3"):
        load_streamed(FakeClient(stored(2, seed=1)), codec, 1, [0, 1, 2], crc_check(codec))
