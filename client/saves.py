"""Saving blocks: reserve, write the reserved ones, commit.

ReserveSave tells which keys to write (others are present, or another
writer has them) and, with the arena mapped, where: the client copies the
bytes into the arena itself. Otherwise WriteBlocks streams them. CommitSave
then publishes them with their checksums (unless checksum="none"), which
every later load checks. A reservation is aborted on any failure before its
commit, so its pages come back at once rather than when it times out.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Any, List, Optional, Sequence, Tuple

import grpc

from kvkeeper.v1 import kvkeeper_pb2 as pb

from .checks import block_views, check_keys
from .checksum import StreamSums
from .columns import slots_of
from .copies import save_summed
from .errors import KVKeeperClientError, from_rpc_error, protocol_error
from .session import Session
from .stream import write_blocks_method, write_frames, write_pack_bytes
from .transport import Transport

__all__ = ["Saves", "SaveResult", "WRITE_CHUNK_BYTES"]

log = logging.getLogger(__name__)

WRITE_CHUNK_BYTES = 1 << 20


@dataclass(frozen=True)
class SaveResult:
    """Per-key outcome counts: written and `committed`, or skipped because
    `present` (already cached), `in_flight` (another writer has it) or
    `not_admitted` (the daemon's admission turned it away: a long run of
    blocks nobody saved lately, on a full cache)."""

    reserved: int
    present: int
    in_flight: int
    committed: int
    not_admitted: int = 0


class Saves:
    """The save operation of one client (see AsyncClient.save)."""

    def __init__(self, session: Session, transport: Transport, checksum_algo: int,
                 copy_threads: int = 0) -> None:
        self._session = session
        self._transport = transport
        self._checksum_algo = checksum_algo
        self._copy_threads = copy_threads   # copies.shards: 0 = auto
        # The bulk messages go through kvkeeper.client.wire (fewer copies, same bytes).
        self._write_blocks_rpc = write_blocks_method(session.channel)

    async def save(self, keys: Sequence[bytes], blocks: Sequence[Any],
                   parent: Optional[bytes] = None) -> SaveResult:
        """Store blocks[i] under keys[i], in rounds of at most max_keys_per_call.
        `parent`: the key before keys[0] in its chain (b"" for a chain's
        first block; None: unknown); each later round's is the key before it."""
        s = self._session
        if len(keys) != len(blocks):
            raise ValueError(f"{len(keys)} keys but {len(blocks)} blocks")
        keys = check_keys(keys, s.key_bytes)
        if parent is not None:
            parent = bytes(parent)
            if parent and s.key_bytes and len(parent) != s.key_bytes:
                raise ValueError(f"parent key has {len(parent)} bytes; the daemon expects "
                                 f"{s.key_bytes} (b\"\" for a chain's first block)")
        views = block_views(blocks, s.namespace.block_bytes, writable=False)
        s.check_open()
        totals = [0, 0, 0, 0, 0]
        # Rounds go one after another. Sending a round's ReserveSave while the
        # round before it copies, and its CommitSave while the next copies,
        # was measured slower on the 2-core machine here: 1024 blocks of 256
        # KiB through the arena, in 8 rounds, took 50-75 ms against 29-33 ms
        # whole (the copies took twice as long beside the daemon's ~10 us a
        # key of reserve and commit work, with one copy thread or two).
        limit = s.max_keys or max(1, len(keys))
        for start in range(0, len(keys), limit):
            r = await self._save_part(keys[start:start + limit], views[start:start + limit],
                                      keys[start - 1] if start else parent)
            for i, v in enumerate((r.reserved, r.present, r.in_flight, r.committed,
                                   r.not_admitted)):
                totals[i] += v
        return SaveResult(*totals)

    async def _save_part(self, keys: List[bytes], views: List[memoryview],
                         parent: Optional[bytes]) -> SaveResult:
        for _ in range(2):  # a second round streams if the arena vanished after reserving
            m = self._transport.live()
            transport = pb.TRANSPORT_SHM if m is not None else pb.TRANSPORT_STREAM
            resp, sid = await self._session.unary_sid(
                "ReserveSave",
                lambda s: pb.ReserveSaveRequest(session_id=s, keys=keys, transport=transport,
                                                parent_key=parent, columns=True),
                retry=False, rebind=True)
            rid = resp.reservation_id
            try:
                try:
                    slots = slots_of(resp)   # one pass (see copies.extents_of)
                except ValueError as e:
                    raise protocol_error(f"ReserveSave: {e}") from None
                if len(slots) != len(keys):
                    raise protocol_error(f"ReserveSave returned {len(slots)} slots for "
                                          f"{len(keys)} keys")
                status = [st for st, _ in slots]
                reserved = [i for i, st in enumerate(status) if st == pb.SLOT_RESERVED]
                present = status.count(pb.SLOT_PRESENT)
                in_flight = status.count(pb.SLOT_IN_FLIGHT)
                refused = status.count(pb.SLOT_NOT_ADMITTED)
                if not rid:
                    if reserved:
                        raise protocol_error("slots reserved without a reservation id")
                    return SaveResult(0, present, in_flight, 0, refused)
                commit = pb.CommitSaveRequest(session_id=sid, reservation_id=rid)
                algo = self._checksum_algo
                if m is not None:
                    if not self._transport.still_current(m):
                        await self._abort(sid, rid)
                        continue
                    exts = [slots[i][1] for i in reserved]
                    for i, ext in zip(reserved, exts):
                        if not ext:
                            raise protocol_error(f"reserved slot {i} has no extents")
                    # Each block is checksummed inside its copy (kvkeeper.client.copies).
                    sums = await save_summed(m, exts, [views[i] for i in reserved], algo,
                                             self._session.namespace.block_bytes * len(reserved),
                                             self._copy_threads)
                else:
                    passing = None if algo == pb.CHECKSUM_NONE else StreamSums(
                        self._session.namespace.block_bytes)
                    await self._write_stream(sid, rid, [(i, views[i]) for i in reserved],
                                             resp.pack_writes, passing, algo)
                    sums = (None if passing is None else await passing.checksums(
                        [algo] * len(reserved), [views[i] for i in reserved], reserved))
                if sums is not None:
                    per_key = [0] * len(keys)
                    for i, c in zip(reserved, sums):
                        per_key[i] = c or 0
                    commit.checksum_algo = algo
                    commit.checksums.extend(per_key)
                cresp = await self._session.unary("CommitSave", lambda s: commit, retry=False,
                                                  rebind=False)
            except BaseException:
                if rid:
                    await self._abort(sid, rid)
                raise
            return SaveResult(len(reserved), present, in_flight, cresp.committed, refused)
        raise KVKeeperClientError("the shared-memory arena changed twice during one save; "
                                  "nothing was written", grpc.StatusCode.ABORTED)

    async def _write_stream(self, sid: str, rid: int, items: List[Tuple[int, memoryview]],
                            pack: bool = False, sums: Optional[StreamSums] = None,
                            algo: int = 0) -> None:
        """WriteBlocks: the reserved blocks in chunks of at most 1 MiB (less if
        the daemon's max message size asks for it); `sums` takes their
        checksums under `algo` in passing (write_frames)."""
        if not items:
            return
        s = self._session
        chunk = WRITE_CHUNK_BYTES
        if s.max_message_bytes:
            chunk = max(4096, min(chunk, s.max_message_bytes - 4096))
        try:
            await self._write_blocks_rpc(write_frames(sid, rid, items, chunk,
                                                      write_pack_bytes(s.max_message_bytes)
                                                      if pack else 0, sums, algo),
                                         timeout=s.timeout, metadata=s.metadata)
        except grpc.RpcError as e:
            raise from_rpc_error(e, "WriteBlocks") from e

    async def _abort(self, sid: str, rid: int) -> None:
        """AbortSave, best effort: the reservation times out on its own anyway."""
        try:
            await self._session.unary(
                "AbortSave", lambda s: pb.AbortSaveRequest(session_id=sid, reservation_id=rid),
                retry=True, rebind=False)
        except Exception as e:
            log.debug("kvkeeper: AbortSave of reservation %d failed: %s", rid, e)
