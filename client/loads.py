"""Loading a lease's blocks: from the mapped arena, or streamed.

With the arena mapped, Load returns each block's extents and the client
copies (or views) the bytes itself; otherwise LoadStream sends them in
chunks. Either way every block's checksum, given at commit, is checked
against the bytes received (unless the client was made with checksum="none"),
except where the caller takes the bytes unchecked: `arena_views` and
`load_chunks` say so.
"""
from __future__ import annotations

from typing import Any, AsyncIterator, List, Optional, Sequence, Tuple

import grpc

from kvkeeper.v1 import kvkeeper_pb2 as pb

from .checks import block_views
from .checksum import StreamSums, verify
from .arena_format import Extent
from .columns import stored_of
from .copies import Stored, extents_of, load_verified
from .errors import ChecksumError, from_rpc_error, protocol_error
from .retry import call_with_retry
from .session import Session
from .stream import Coverage, chunks, load_request, load_stream_method
from .transport import Transport
from .wire import Chunk

__all__ = ["Loads"]


def _check_span(ext: List[Extent], block_bytes: int, what: str) -> None:
    """A ref whose extents do not add up to a block is the daemon's error,
    caught before any byte is copied or handed out."""
    length = sum(n for _, n in ext)
    if length != block_bytes:
        raise protocol_error(f"{what} spans {length} bytes, not {block_bytes}")


class Loads:
    """The load operations of one client (see AsyncClient for their use)."""

    def __init__(self, session: Session, transport: Transport, checksum_algo: int,
                 copy_threads: int = 0) -> None:
        self._session = session
        self._transport = transport
        self._verifies = checksum_algo != pb.CHECKSUM_NONE
        self._copy_threads = copy_threads   # copies.shards: 0 = auto
        # The bulk messages go through kvkeeper.client.wire (fewer copies, same bytes).
        self._load_stream_rpc = load_stream_method(session.channel)

    @property
    def _block_bytes(self) -> int:
        return self._session.namespace.block_bytes

    async def _verify(self, expected: Sequence[Tuple[int, int]], bufs: Sequence[Any]) -> None:
        if self._verifies:
            await verify(expected, bufs)

    async def block_refs(self, lease_id: int) -> pb.LoadResponse:
        """Load: where the lease's blocks lie in the arena, and their checksums,
        as BlockRefs (LoadResponse.blocks)."""
        return await self._session.unary(
            "Load", lambda s: pb.LoadRequest(session_id=s, lease_id=lease_id),
            retry=True, rebind=False)

    async def _stored(self, lease_id: int) -> List[Stored]:
        """Load, asked for columns (read several times faster than BlockRefs):
        each block's (checksum_algo, checksum, extents), in lease order."""
        resp = await self._session.unary(
            "Load", lambda s: pb.LoadRequest(session_id=s, lease_id=lease_id, columns=True),
            retry=True, rebind=False)
        try:
            return stored_of(resp)
        except ValueError as e:
            raise protocol_error(f"Load: {e}") from None

    def arena_views(self, refs: Sequence[Any]) -> Optional[List[List[memoryview]]]:
        """See AsyncClient.arena_views. Synchronous and safe from any thread:
        it only reads the mapping."""
        m = self._transport.mapping
        if m is None:
            return None
        exts = [ref[2] if type(ref) is tuple else extents_of(ref.extents) for ref in refs]
        for i, ext in enumerate(exts):
            _check_span(ext, self._block_bytes, f"block ref {i}")
        try:
            if not m.still_valid():
                return None
            return m.gather_readonly(exts)
        except ValueError as e:
            # Another thread (Client's event loop) may close the mapping meanwhile.
            if m.closed:
                return None
            raise protocol_error(f"block ref outside the arena: {e}") from None

    async def load(self, lease_id: int) -> List[bytes]:
        """The bytes of every block of the lease, in lease order."""
        m = self._transport.live()
        if m is not None:
            refs = await self._stored(lease_id)
            if self._transport.still_current(m):
                blocks = [m.read(ext) for _, _, ext in refs]
                await self._verify([(algo, value) for algo, value, _ in refs], blocks)
                return blocks
        return await self._load_stream(lease_id, None)

    async def load_into(self, lease_id: int, outs: Sequence[Any]) -> None:
        """Copy the lease's blocks into `outs` (see AsyncClient.load_into)."""
        views = block_views(outs, self._block_bytes, writable=True)
        m = self._transport.live()
        if m is not None:
            blocks = await self._stored(lease_id)
            if len(blocks) != len(views):
                raise ValueError(f"lease {lease_id} holds {len(blocks)} blocks but "
                                 f"{len(views)} buffers were given")
            if self._transport.still_current(m):
                bb = self._block_bytes
                for i, (_, _, ext) in enumerate(blocks):
                    _check_span(ext, bb, f"block {i} of lease {lease_id}")
                # Each block is verified inside its copy (kvkeeper.client.copies).
                bad = await load_verified(m, blocks, views, self._verifies, bb * len(views),
                                          self._copy_threads)
                if bad:
                    raise ChecksumError(bad)
                return
        await self._load_stream(lease_id, views)

    async def load_chunks(self, lease_id: int,
                          max_blocks: Optional[int] = None) -> AsyncIterator[Chunk]:
        """LoadStream's chunks as they arrive, unchecked and not retried (see
        AsyncClient.load_chunks)."""
        s = self._session
        s.check_open()
        cov = Coverage(lease_id, self._block_bytes, max_blocks)
        req = load_request(s.id, lease_id)
        try:
            call = self._load_stream_rpc(req, timeout=s.timeout, metadata=s.metadata)
            async for ch in chunks(call, cov):
                yield ch
        except grpc.RpcError as e:
            raise from_rpc_error(e, "LoadStream") from e
        cov.finish()

    async def _load_stream(self, lease_id: int, views: Optional[List[memoryview]]) -> List[bytes]:
        """LoadStream, assembled into `views` (load_into) or into new bytes (load).
        The stream is read-only, so a whole stream is retried on UNAVAILABLE."""
        s = self._session
        s.check_open()
        bb = self._block_bytes
        req = load_request(s.id, lease_id)

        async def attempt() -> Tuple[Coverage, dict, StreamSums]:
            cov = Coverage(lease_id, bb, len(views) if views is not None else None)
            parts: dict = {}    # index -> [(offset, data)], for load()
            arrived = StreamSums(bb)   # each piece hashed while still in cache
            call = self._load_stream_rpc(req, timeout=s.timeout, metadata=s.metadata)
            async for ch in chunks(call, cov):
                end = ch.offset + ch.data.nbytes
                if views is not None:
                    dst = views[ch.index]
                    dst[ch.offset:end] = ch.data
                    if self._verifies:   # the bytes as they now stand in the caller's buffer
                        arrived.piece(ch.index, ch.offset, dst[ch.offset:end], ch.checksum_algo)
                else:
                    parts.setdefault(ch.index, []).append((ch.offset, ch.data))
                    if self._verifies:   # the received bytes; load() joins them in one copy
                        arrived.piece(ch.index, ch.offset, ch.data, ch.checksum_algo)
            return cov, parts, arrived

        try:
            cov, parts, arrived = await call_with_retry(attempt, max_retries=s.max_retries)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "LoadStream") from e
        sums = cov.finish()
        n = len(sums)
        if views is not None:
            if n != len(views):
                raise ValueError(f"lease {lease_id} holds {n} blocks but {len(views)} buffers "
                                 "were given")
            bufs: List[Any] = views
            out: List[bytes] = []
        else:
            out = [b"".join(d for _, d in sorted(parts[i], key=lambda p: p[0]))
                   for i in range(n)]
            bufs = out
        if self._verifies:
            await verify(sums, bufs, arrived)
        return out
