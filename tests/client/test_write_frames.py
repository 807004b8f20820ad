"""write_frames: WriteChunks of the reserved blocks; with pack, runs of
consecutive entries go whole, several to a chunk (the daemon said it takes
them: ReserveSaveResponse.pack_writes); blocks too big to pack go in pieces."""
from __future__ import annotations

from typing import List, Tuple

from kvkeeper.client.stream import write_frames
from kvkeeper.client.wire import parse_write_chunk


def _items(idx: List[int], size: int) -> List[Tuple[int, memoryview]]:
    return [(i, memoryview(bytes([i]) * size)) for i in idx]


def _parsed(frames) -> List[tuple]:
    return [(c.session_id, c.reservation_id, c.index, c.offset, bytes(c.data))
            for c in map(parse_write_chunk, frames)]


def test_runs_of_consecutive_entries_pack_up_to_the_limit() -> None:
    got = _parsed(write_frames("s", 9, _items([0, 1, 2, 4, 5, 7], 10), chunk=1000, pack=25))
    assert got == [("s", 9, 0, 0, bytes([0]) * 10 + bytes([1]) * 10),   # two fit in 25
                   ("", 0, 2, 0, bytes([2]) * 10),                       # 3 is not reserved
                   ("", 0, 4, 0, bytes([4]) * 10 + bytes([5]) * 10),
                   ("", 0, 7, 0, bytes([7]) * 10)]


def test_without_pack_every_block_goes_alone_in_pieces_of_chunk() -> None:
    got = _parsed(write_frames("s", 9, _items([0, 1], 10), chunk=4))
    assert [(i, o, len(d)) for _, _, i, o, d in got] == \
        [(0, 0, 4), (0, 4, 4), (0, 8, 2), (1, 0, 4), (1, 4, 4), (1, 8, 2)]
    assert got[0][:2] == ("s", 9) and all(g[:2] == ("", 0) for g in got[1:])


def test_blocks_that_do_not_fit_twice_go_alone() -> None:
    got = _parsed(write_frames("s", 9, _items([0, 1], 10), chunk=6, pack=19))
    assert [(i, o, len(d)) for _, _, i, o, d in got] == [(0, 0, 6), (0, 6, 4), (1, 0, 6), (1, 6, 4)]
