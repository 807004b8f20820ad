"""How LoadStream cuts a lease into chunks: sizes, and groups of whole blocks; the
bulk messages' codecs.

A block larger than a chunk goes in pieces of STREAM_CHUNK_BYTES; blocks that
fit twice go packed, as many whole blocks as STREAM_PACK_BYTES holds
(LoadRequest.pack_blocks). The servicer frames each group (client.wire).
"""
from __future__ import annotations

from typing import Any, Iterator, List, Sequence, Tuple

from kvkeeper.client.wire import frame_or_message, parse_write_chunk

# 1 MiB: 4 MiB chunks overflow the L2 cache and measured slower end to end.
STREAM_CHUNK_BYTES = 1 << 20
# Packed chunks (LoadRequest.pack_blocks) of small blocks: up to 1 MiB. 12 MiB
# in 192 KiB messages took 25-37 ms through raw grpc over TCP here, in 4 MiB
# ones 25 ms and in one message 87 ms. Through the daemon to a client's
# blocking channel (keyed LoadStream, 3 runs each, 2026-12-02), 12 MiB took
# 9.3-11.2 ms in 1 MiB packs against 13.6-17.4 ms in 2 MiB ones (192 KiB
# blocks), 10.4-11.6 against 13.6-13.7 ms (384 KiB) and 8.9-9.8 against
# 22.2-24.7 ms (64 KiB); 512 KiB packs 10.6-11.2 ms, one block a message 14.7-16.9.
STREAM_PACK_BYTES = 1 << 20
# Blocks per packed chunk at most: their checksums (varints of up to 10 bytes)
# then fit in the margin left for a chunk's other fields.
MAX_PACK_BLOCKS = 256
# Room for a BlockChunk's other fields (the client keeps the same margin for WriteChunk).
CHUNK_OVERHEAD_BYTES = 4096
# The bulk messages go through kvkeeper.client.wire (the same bytes, fewer
# copies): LoadStream yields frames built from the arena in one copy, and
# WriteBlocks reads each chunk's data as a view of the received message.
# Match answers bytes built there too, except when it carries BlockRefs.
BULK_CODECS = {"LoadStream": {"response_serializer": frame_or_message},
               "WriteBlocks": {"request_deserializer": parse_write_chunk},
               "Match": {"response_serializer": frame_or_message}}


def stream_message_bytes(block_bytes: int) -> int:
    """The data bytes of a LoadStream chunk by default, for a lease of blocks
    of this size asked with pack_blocks: as many whole blocks as a packed
    chunk holds, or one block, or a piece of one."""
    per = min(STREAM_PACK_BYTES // block_bytes, MAX_PACK_BLOCKS)
    return per * block_bytes if per >= 2 else min(STREAM_CHUNK_BYTES, block_bytes)


def chunk_groups(blocks: Sequence[Any], pack_bytes: int) -> Iterator[Tuple[int, List[Any]]]:
    """(lease index of the first, blocks) per LoadStream chunk group: runs of
    consecutive blocks with the same checksum algorithm, as many as fit in
    pack_bytes, MAX_PACK_BLOCKS at most (one each when pack_bytes is 0 or a
    block does not fit twice). The first groups ramp up, 1, 2, 4 ... blocks:
    the client starts copying the first block in while the rest is on the
    way, instead of waiting for a whole packed chunk."""
    run: List[Any] = []
    start, cap = 0, 1
    for i, b in enumerate(blocks):
        if run and (len(run) == cap or (len(run) + 1) * b.ns.block_bytes > pack_bytes
                    or (run[0].checksum or (0,))[0] != (b.checksum or (0,))[0]):
            yield start, run
            run, cap = [], min(2 * cap, MAX_PACK_BLOCKS)
        if not run:
            start = i
        run.append(b)
    if run:
        yield start, run
