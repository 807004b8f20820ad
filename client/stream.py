"""The streaming byte path: LoadStream and WriteBlocks with hand-built frames.

`LoadStream.chunks` yields each BlockChunk as it arrives (wire.Chunk: its
data a view of the received message, not a copy), checking it against the
lease as it goes; at the end of the stream `Coverage.finish` says whether
every block arrived whole, once, and returns the checksums the daemon sent.
The caller copies the bytes where they belong as they come (load_into: the
caller's buffers; the connector: the KV cache) and verifies them.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, Dict, Iterator, List, NamedTuple, Optional, Sequence, Tuple

import grpc

from kvkeeper.v1 import kvkeeper_pb2 as pb

from .errors import protocol_error
from .checksum import StreamSums
from .wire import Chunk, encode_write_chunk, parse_block_chunk

__all__ = ["KEYED_UNKNOWN", "WRITE_PACK_BYTES", "Coverage", "KeyedStream", "check_head", "chunks",
           "keyed_request", "load_request", "load_stream_method", "write_blocks_method",
           "write_frames", "write_pack_bytes"]

_SERVICE = pb.DESCRIPTOR.services_by_name["KVKeeper"].full_name


def load_request(session_id: str, lease_id: int) -> pb.LoadRequest:
    """LoadStream's request. pack_blocks: small blocks come several to a
    message (Coverage.take splits them), a fraction of the per-message cost
    of gRPC on both sides; a daemon that ignores it sends one per message."""
    return pb.LoadRequest(session_id=session_id, lease_id=lease_id, pack_blocks=True)


# What a daemon without the keyed form answers it: lease 0 is unknown.
KEYED_UNKNOWN = (grpc.StatusCode.NOT_FOUND, grpc.StatusCode.FAILED_PRECONDITION)


def keyed_request(session_id: str, keys: Sequence[bytes]) -> pb.LoadRequest:
    """A keyed LoadStream's request: match `keys` under a report_use lease
    (the caller reports its use with its own lookup) and stream it."""
    return pb.LoadRequest(session_id=session_id, keys=keys, report_use=True, pack_blocks=True)


class KeyedStream(NamedTuple):
    """A keyed LoadStream: its lease (0: nothing matched), the leading keys
    matched, and the lease's chunks, one block each, as load_chunks yields them."""

    lease_id: int
    matched: int
    chunks: Iterator[Chunk]


def check_head(head: Chunk) -> None:
    """A keyed LoadStream's first chunk names its lease and carries no block."""
    if head.data.nbytes or head.checksums or (head.matched and not head.lease_id):
        raise protocol_error(f"a keyed LoadStream began with block {head.index} "
                             f"({head.data.nbytes} bytes) instead of naming its lease")


def load_stream_method(channel: Any) -> Any:
    """LoadStream, parsing each BlockChunk into a wire.Chunk."""
    return channel.unary_stream(f"/{_SERVICE}/LoadStream",
                                request_serializer=pb.LoadRequest.SerializeToString,
                                response_deserializer=parse_block_chunk)


def write_blocks_method(channel: Any) -> Any:
    """WriteBlocks, sending frames built by `write_frames`."""
    return channel.stream_unary(f"/{_SERVICE}/WriteBlocks",
                                request_serializer=bytes,
                                response_deserializer=pb.WriteBlocksResponse.FromString)


# Runs of small blocks go whole, several to a WriteChunk of up to 2 MiB, where
# the daemon takes them: fewer messages through gRPC (as LoadStream's packed chunks).
WRITE_PACK_BYTES = 2 << 20


def write_pack_bytes(max_message_bytes: int) -> int:
    """The most data bytes of a packed WriteChunk, within the daemon's message limit."""
    if not max_message_bytes:
        return WRITE_PACK_BYTES
    return min(WRITE_PACK_BYTES, max_message_bytes - 4096)


def write_frames(sid: str, rid: int, items: Sequence[Tuple[int, memoryview]], chunk: int,
                 pack: int = 0, sums: Optional[StreamSums] = None, algo: int = 0):
    """Serialized WriteChunks of the (index, block view) items, each built in
    one copy from the views; the first carries the session and reservation.
    pack: where the daemon takes them (ReserveSaveResponse.pack_writes), runs
    of consecutive entries go whole, several to a chunk of up to this many bytes.
    sums: each block's checksum under `algo` is taken there, piece by piece,
    right after the piece is framed (its bytes still in cache)."""
    head = [sid, rid]

    def frame(idx: int, off: int, views: List[memoryview]) -> bytes:
        out = encode_write_chunk(head[0], head[1], idx, off, views)
        head[:] = ["", 0]
        if sums is not None:
            for j, v in enumerate(views):   # several views: whole blocks idx, idx + 1, ...
                sums.piece(idx + j, off, v, algo)
        return out

    run: List[Tuple[int, memoryview]] = []
    for idx, view in items:
        n = view.nbytes
        if run and (idx != run[-1][0] + 1 or (len(run) + 1) * n > pack):
            yield frame(run[0][0], 0, [v for _, v in run])
            run = []
        if 2 * n <= pack:
            run.append((idx, view))
            continue
        for off in range(0, n, chunk):
            yield frame(idx, off, [view[off:off + chunk]])
    if run:
        yield frame(run[0][0], 0, [v for _, v in run])


class Coverage:
    """Checks a LoadStream's chunks: each within its block, no block beyond
    `max_blocks` (the caller's buffers) when given, and at the end every
    block 0..n-1 covered exactly once, without gaps."""

    def __init__(self, lease_id: int, block_bytes: int, max_blocks: Optional[int] = None) -> None:
        self.lease_id = lease_id
        self.bb = block_bytes
        self.max_blocks = max_blocks
        self.ranges: Dict[int, List[Tuple[int, int]]] = {}
        self.sums: Dict[int, Tuple[int, int]] = {}

    def take(self, ch: Chunk) -> Sequence[Chunk]:
        """The chunk as chunks of one block each, every one checked (add): a
        chunk of k whole blocks (BlockChunk.checksums) is cut into k views of
        its data, each with its block's checksum."""
        if not ch.checksums:
            self.add(ch)
            return (ch,)
        k, bb, n = len(ch.checksums), self.bb, ch.data.nbytes
        if ch.offset != 0 or n != k * bb:
            raise protocol_error(f"a chunk of {k} whole blocks from block {ch.index} holds "
                                 f"{n} bytes at offset {ch.offset}, not {k * bb} at 0")
        out = [Chunk(ch.index + j, 0, ch.data[j * bb:(j + 1) * bb], ch.checksum_algo, c)
               for j, c in enumerate(ch.checksums)]
        for c in out:
            self.add(c)
        return out

    def add(self, ch: Chunk) -> None:
        idx, off, n = ch.index, ch.offset, ch.data.nbytes
        if off + n > self.bb:
            raise protocol_error(f"chunk [{off}, {off + n}) of block {idx} is beyond "
                                 f"block_bytes {self.bb}")
        if self.max_blocks is not None and idx >= self.max_blocks:
            raise ValueError(f"lease {self.lease_id} holds more blocks than the "
                             f"{self.max_blocks} buffers given")
        self.ranges.setdefault(idx, []).append((off, n))
        if ch.checksum_algo:
            self.sums[idx] = (ch.checksum_algo, ch.checksum)

    def complete(self, idx: int) -> bool:
        """Whether block `idx` has all its bytes now (assuming no overlaps,
        which finish() rules out)."""
        return sum(n for _, n in self.ranges.get(idx, ())) == self.bb

    def finish(self) -> List[Tuple[int, int]]:
        """(checksum_algo, checksum) per block, in lease order; raises if a
        block is missing, short, or overlapping."""
        n = len(self.ranges)
        if sorted(self.ranges) != list(range(n)):
            raise protocol_error(f"LoadStream of lease {self.lease_id} sent block indices "
                                 f"{sorted(self.ranges)}")
        for idx, rs in self.ranges.items():
            pos = 0
            for off, length in sorted(rs):
                if off != pos:
                    raise protocol_error(f"LoadStream left a gap or overlap in block {idx} "
                                         f"at byte {pos}")
                pos += length
            if pos != self.bb:
                raise protocol_error(f"LoadStream sent {pos} of {self.bb} bytes of block {idx}")
        return [self.sums.get(i, (pb.CHECKSUM_NONE, 0)) for i in range(n)]


async def chunks(call: Any, coverage: Coverage) -> AsyncIterator[Chunk]:
    """The chunks of a started LoadStream call, one block each, checked by
    `coverage` before they are yielded; the call is cancelled if the consumer stops early."""
    try:
        async for packed in call:
            for ch in coverage.take(packed):
                yield ch
    finally:
        call.cancel()   # no-op once the stream ended; stops it on our errors
