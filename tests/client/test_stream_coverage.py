"""Coverage.take: a packed chunk (several whole blocks, BlockChunk.checksums)
becomes one view per block with its checksum; one that does not hold exactly
its blocks is the daemon's error, before any byte is handed on."""
from __future__ import annotations

import pytest

from kvkeeper.client import KVKeeperClientError
from kvkeeper.client.stream import Coverage
from kvkeeper.client.wire import Chunk, encode_block_chunk, parse_block_chunk

BB = 100


def _packed(index: int, data: bytes, sums: list, offset: int = 0) -> Chunk:
    return parse_block_chunk(encode_block_chunk(index, offset, [data], 2, 0, sums))


def test_a_packed_chunk_is_split_into_views_of_its_blocks() -> None:
    data = bytes(range(200)) + b"\x07" * BB
    cov = Coverage(1, BB)
    got = cov.take(_packed(0, data, [11, 0, 33]))
    assert [(c.index, c.offset, bytes(c.data), c.checksum_algo, c.checksum) for c in got] == \
        [(i, 0, data[i * BB:(i + 1) * BB], 2, s) for i, s in enumerate([11, 0, 33])]
    assert all(c.data.obj is got[0].data.obj for c in got)   # views, no copies
    assert all(cov.complete(i) for i in range(3))
    assert cov.finish() == [(2, 11), (2, 0), (2, 33)]


def test_plain_chunks_pass_as_they_are() -> None:
    cov = Coverage(1, BB)
    ch = parse_block_chunk(encode_block_chunk(0, 0, [b"x" * BB], 2, 5))
    assert cov.take(ch) == (ch,)
    assert cov.finish() == [(2, 5)]


@pytest.mark.parametrize("data,sums,offset", [
    (b"x" * (2 * BB + 1), [1, 2], 0),   # a byte too many
    (b"x" * (2 * BB), [1, 2, 3], 0),     # a checksum too many
    (b"x" * (2 * BB), [1, 2], BB),       # not at the start of its first block
])
def test_a_packed_chunk_that_is_not_whole_blocks_is_refused(data: bytes, sums: list,
                                                            offset: int) -> None:
    cov = Coverage(1, BB)
    with pytest.raises(KVKeeperClientError, match="whole blocks"):
        cov.take(_packed(0, data, sums, offset))
    assert cov.ranges == {}


def test_a_packed_chunk_beyond_the_callers_buffers_is_refused() -> None:
    cov = Coverage(1, BB, max_blocks=2)
    with pytest.raises(ValueError, match="more blocks than the 2 buffers"):
        cov.take(_packed(1, b"x" * (2 * BB), [1, 2]))


def test_a_keyed_streams_head_must_name_its_lease_and_carry_no_block() -> None:
    from kvkeeper.client.stream import check_head
    from kvkeeper.client.wire import encode_stream_head

    check_head(parse_block_chunk(encode_stream_head(7, 3)))
    check_head(parse_block_chunk(encode_stream_head(0, 0)))   # nothing matched
    for bad in (encode_block_chunk(0, 0, [b"x" * BB], 2, 5),   # a block where the head goes
                encode_stream_head(0, 3)):                      # matched, but no lease
        with pytest.raises(KVKeeperClientError, match="instead of naming its lease"):
            check_head(parse_block_chunk(bad))
