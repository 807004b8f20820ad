"""StreamSums: checksums computed as a stream's pieces land must name exactly
the blocks `verify` over the finished buffers would, whatever the pieces'
sizes and order, the algorithms, and where the bytes were damaged."""
from __future__ import annotations

import asyncio

import pytest
from hypothesis import given, settings, strategies as st

from kvkeeper.client.checksum import ALGOS, StreamSums, verify
from kvkeeper.client.errors import ChecksumError
from kvkeeper.v1 import kvkeeper_pb2 as pb

BB = 96
ALGO_CHOICES = [pb.CHECKSUM_XXH3_64, pb.CHECKSUM_CRC32, pb.CHECKSUM_NONE]


def _bad(coro) -> list[int]:
    try:
        asyncio.run(coro)
    except ChecksumError as e:
        return e.bad_indices
    return []


@st.composite
def streams(draw):
    n = draw(st.integers(1, 6))
    blocks = [draw(st.binary(min_size=BB, max_size=BB)) for _ in range(n)]
    algos = [draw(st.sampled_from(ALGO_CHOICES)) for _ in range(n)]
    pieces = []   # (index, offset, length)
    for i in range(n):
        cuts = sorted(draw(st.sets(st.integers(1, BB - 1), max_size=3)))
        bounds = [0, *cuts, BB]
        pieces += [(i, a, b - a) for a, b in zip(bounds, bounds[1:])]
    order = draw(st.permutations(range(len(pieces))))
    if draw(st.booleans()):
        order = sorted(order)   # in order, as the daemon sends them
    # Damage: (piece position in arrival order, byte within it), made after
    # the piece landed (a late write: only verify at the end can see it) or before.
    damage = draw(st.lists(st.tuples(st.integers(0, len(pieces) - 1), st.integers(0, BB - 1),
                                     st.booleans()), max_size=3))
    return blocks, algos, [pieces[j] for j in order], damage


@settings(max_examples=300, deadline=None)
@given(streams())
def test_sums_names_the_same_bad_blocks_as_verify_at_the_end(s) -> None:
    blocks, algos, pieces, damage = s
    expected = [(a, ALGOS[a](b) if a in ALGOS else 0) for a, b in zip(algos, blocks)]
    bufs = [bytearray(BB) for _ in blocks]
    sums = StreamSums(BB)
    for pos, (i, off, n) in enumerate(pieces):
        src = bytearray(blocks[i][off:off + n])
        for p, at, after in damage:
            if p == pos and not after:
                src[at % n] ^= 0x01
        bufs[i][off:off + n] = src
        view = memoryview(bufs[i])[off:off + n]
        sums.piece(i, off, view, algos[i] if off == 0 else pb.CHECKSUM_NONE)
        for p, at, after in damage:
            if p == pos and after:   # changed after it was hashed on arrival
                bufs[i][off + at % n] ^= 0x01
    late = {pieces[p][0] for p, _, after in damage if after}
    want = _bad(verify(expected, bufs))
    got = _bad(verify(expected, bufs, sums))
    # A block damaged after it was hashed on arrival is caught only if it was
    # left for the end (its pieces out of order); otherwise no false alarm,
    # and every block damaged on the way (before it landed) is caught.
    assert set(got) <= set(want) | late
    early = {pieces[p][0] for p, _, after in damage if not after} - late
    assert {i for i in want if i in early} <= set(got)
    assert got == sorted(got)
    if not late:
        assert got == want


def test_a_block_in_order_is_hashed_on_arrival_and_out_of_order_is_left_for_the_end() -> None:
    data = bytes(range(BB))
    a = StreamSums(BB)
    a.piece(0, 0, memoryview(data)[:40], pb.CHECKSUM_XXH3_64)
    a.piece(0, 40, memoryview(data)[40:], pb.CHECKSUM_NONE)
    a.piece(1, 40, memoryview(data)[40:], pb.CHECKSUM_NONE)   # its tail first
    a.piece(1, 0, memoryview(data)[:40], pb.CHECKSUM_XXH3_64)
    a.piece(2, 0, memoryview(data), pb.CHECKSUM_CRC32)
    a.piece(3, 0, memoryview(data), pb.CHECKSUM_NONE)
    assert a.done == {0: (pb.CHECKSUM_XXH3_64, ALGOS[pb.CHECKSUM_XXH3_64](data)),
                      2: (pb.CHECKSUM_CRC32, ALGOS[pb.CHECKSUM_CRC32](data))}


def test_an_algorithm_other_than_the_expected_ones_is_checked_again_at_the_end() -> None:
    data = bytes(BB)
    a = StreamSums(BB)
    a.piece(0, 0, memoryview(data), pb.CHECKSUM_CRC32)
    x = ALGOS[pb.CHECKSUM_XXH3_64](data)
    asyncio.run(verify([(pb.CHECKSUM_XXH3_64, x)], [data], a))
    with pytest.raises(ChecksumError) as info:
        asyncio.run(verify([(pb.CHECKSUM_XXH3_64, x ^ 1)], [data], a))
    assert info.value.bad_indices == [0]


def test_checksums_of_a_subset_map_each_buffer_to_its_block_index() -> None:
    """A save's reserved blocks are a subset of its keys: bufs[k] is block
    indices[k], taken in passing or (block 5, never seen) computed now."""
    data = [bytes([i]) * BB for i in range(6)]
    a = StreamSums(BB)
    for i in (1, 3):
        a.piece(i, 0, memoryview(data[i]), pb.CHECKSUM_XXH3_64)
    a.done[3] = (pb.CHECKSUM_XXH3_64, 12345)   # a value only the taken path returns
    got = asyncio.run(a.checksums([pb.CHECKSUM_XXH3_64] * 3, [data[1], data[3], data[5]],
                                  [1, 3, 5]))
    xxh = ALGOS[pb.CHECKSUM_XXH3_64]
    assert got == [xxh(data[1]), 12345, xxh(data[5])]
