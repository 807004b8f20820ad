"""Streamed loads: a lease's blocks copied into the KV cache as they arrive.

Where the worker cannot map the daemon's arena (another host, or
kvkeeper_transport=stream) it streams the lease (LoadStream). The client's
event-loop thread receives the chunks and parses them (each chunk's data a
view of the received message, no copy); the calling thread takes them as
they come (Client.load_chunks) and copies each block straight from the
message into the paged KV tensors, layer by layer (BlockCodec.copy_layer_in,
as the shared-memory path copies from the arena), then checks the block's
checksum over the bytes it was copied from, as the shared-memory path does
(copy_in.py), while the next blocks are still on the wire. Small blocks
come several to a message (LoadRequest.pack_blocks), which the client hands
on as one chunk per block, each a view of that message. A block larger
than one chunk (the daemon sends at most 1 MiB per chunk) is gathered in a
staging row first, then copied the same way.

Nothing is reported loaded before the stream has ended with every block
whole (the client checks that): a stream that breaks or comes short fails
the whole load, and vLLM recomputes it, whatever was already copied.
Blocks that fail their checksum are returned, for the caller to report and
drop from the daemon; the leading good ones are loaded.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple

import torch

from ..blocks import BlockCodec, block_source
from .timings import LoadTimings

__all__ = ["load_streamed"]


def _copy_block(codec: BlockCodec, block_id: int, src: torch.Tensor) -> None:
    for layer in range(codec.num_layers):
        codec.copy_layer_in(layer, [block_id], [src])


def load_streamed(client: Any, codec: BlockCodec, lease_id: int, block_ids: Sequence[int],
                  check: Callable[[int, Tuple[int, int], torch.Tensor], bool],
                  timings: Optional[LoadTimings] = None,
                  chunks: Optional[Iterable[Any]] = None) -> Tuple[int, List[int]]:
    """Stream lease `lease_id` into vLLM blocks `block_ids` (its leading
    len(block_ids) blocks; later ones are received and dropped). check(block
    id, (checksum_algo, checksum), the bytes copied from) says whether a
    copied block is intact.
    Returns (leading blocks loaded and intact, lease positions that failed
    their check). Raises if the stream fails or leaves a block incomplete.
    timings, if given, gets the seconds until the first chunk came
    (stream_first) and those spent copying and checking (stream_copy).
    chunks: the lease's chunks of a stream already started (a keyed
    LoadStream, Client.stream_matching), instead of client.load_chunks."""
    n = len(block_ids)
    bb = codec.block_bytes
    sums: Dict[int, Tuple[int, int]] = {}
    staged: Dict[int, Tuple[torch.Tensor, List[int]]] = {}   # index -> (row, [bytes got])
    intact: Dict[int, bool] = {}

    t0 = time.perf_counter()
    first = busy = 0.0

    def done(i: int, src: torch.Tensor) -> None:
        nonlocal busy
        t = time.perf_counter()
        _copy_block(codec, block_ids[i], src)
        intact[i] = check(block_ids[i], sums.get(i, (0, 0)), src)
        busy += time.perf_counter() - t

    for ch in (chunks if chunks is not None else client.load_chunks(lease_id)):
        if not first:
            first = time.perf_counter() - t0
        i = ch.index
        if ch.checksum_algo:
            sums[i] = (ch.checksum_algo, ch.checksum)
        if i >= n:
            continue
        size = ch.data.nbytes
        if ch.offset == 0 and size == bb and i not in staged:
            done(i, block_source([ch.data], bb))   # the usual case: one chunk per block
            continue
        row, got = staged.setdefault(i, (codec.new_rows(1)[0], [0]))
        row[ch.offset:ch.offset + size] = block_source([ch.data], size)
        got[0] += size
        if got[0] == bb:
            del staged[i]
            done(i, row)
    if timings is not None:
        timings.stream_first, timings.stream_copy = first, busy
    # load_chunks checked at the end that every block the lease holds came whole.
    missing = [i for i in range(n) if i not in intact]
    if missing:
        raise RuntimeError(f"LoadStream of lease {lease_id} sent {len(intact)} whole blocks of "
                           f"the {n} asked for (missing positions {missing[:5]})")
    bad = [i for i in range(n) if not intact[i]]
    return (bad[0] if bad else n), bad
