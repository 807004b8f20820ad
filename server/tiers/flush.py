"""Flushing down: the arena's committed blocks written to the tiers below it.

Write-through (CommitSave answers once the blocks are below), write-back
(flushed in the background; each block stays pinned by an internal lease
from its commit until its flush ends, so the arena evicts only blocks that
are below already) and admission after N hits. The stack (stack.py) owns a
Flusher and calls it; nothing else does.

Three rules keep an acknowledged save below:
* a flush runs as its own task, never as part of the caller's: a CommitSave
  whose caller gave up (grpc cancels its handler) does not cancel the write,
  which would leave the book's entry WRITING for good (never written again,
  never promotable);
* a write-through flush is not subject to the book's admission rule: the
  operator asked for every committed block to be below before the answer;
* a copy the book evicted is deleted before anything writes its key again:
  a late delete, by path, would remove the new copy just acknowledged.
"""
from __future__ import annotations

import asyncio
import logging
from typing import Any, Callable, Optional, Protocol, Sequence

from ..errors import ResourceExhausted
from ..ledger import Block, Lease, Ledger, Namespace
from ..ops.ratelog import RepeatLog
from .backend import ArenaBackend, TierError
from .deletes import Deletes

__all__ = ["Flusher"]

log = logging.getLogger("kvkeeper.stack")

Where = tuple[bytes, bytes]


class _Tier(Protocol):   # what of stack.LowerTier a flush uses
    name: Any
    write_back: bool
    admit_after_hits: int
    flush_failures: int
    keeps_book: bool

    def loc(self, ns: bytes, key: bytes, nbytes: int) -> Any: ...
    async def write_block(self, src: Any, src_loc: Any, loc: Any,
                          checksum: Optional[Any] = None) -> None: ...
    def refusal(self, e: TierError) -> Optional[Exception]: ...
    async def forget(self, where: Where) -> None: ...


class Flusher:
    def __init__(self, ledger: Ledger, host: ArenaBackend,
                 host_loc: Callable[[Block], Any], clock: Callable[[], float]) -> None:
        self.ledger = ledger
        self.host = host
        self._host_loc = host_loc
        self.clock = clock
        self.tasks: set[asyncio.Task[Any]] = set()
        self.deletes = Deletes()   # evicted copies being deleted: flushes and probes wait
        self._unflushed = RepeatLog(log, "tier_flush_failed")

    def admit(self, tiers: Sequence[_Tier], ns: Namespace, keys: Sequence[bytes]) -> None:
        """Admission: a block reaching a tier's admit_after_hits is flushed now."""
        for t in tiers:
            if t.admit_after_hits:
                due = self.ledger.due_for_admission(t.name, ns, keys, t.admit_after_hits)
                if due:
                    self.spawn(ns, due, t)

    async def committed(self, tiers: Sequence[_Tier], ns: Namespace,
                        keys: Sequence[bytes]) -> None:
        """Called after a client's commit. Write-through: returns once below."""
        for t in tiers:
            if t.admit_after_hits or not keys:
                continue
            if t.write_back:
                self.spawn(ns, keys, t)
                continue
            task = self._task(ns, keys, t, strict=True)
            if task is not None:
                await asyncio.shield(task)   # the caller may go; the write goes on

    def spawn(self, ns: Namespace, keys: Sequence[bytes], tier: _Tier) -> None:
        self._task(ns, keys, tier, strict=False)

    def _task(self, ns: Namespace, keys: Sequence[bytes], tier: _Tier,
              strict: bool) -> Optional[asyncio.Task[None]]:
        # Pin now, synchronously, so eviction cannot take the blocks before the task runs.
        lease = self.ledger.pin_internal(ns, keys)
        if lease is None:
            return None
        task = asyncio.get_running_loop().create_task(self._flush(lease, tier, strict=strict))
        self.tasks.add(task)
        task.add_done_callback(self.tasks.discard)
        if strict:   # awaited (shielded): a failure is its caller's
            task.add_done_callback(lambda t: t.cancelled() or t.exception())
        return task

    async def drain(self) -> None:
        """Finish every flush (graceful shutdown, admin Drain)."""
        while self.tasks:
            await asyncio.gather(*list(self.tasks), return_exceptions=True)

    async def _flush(self, lease: Lease, tier: _Tier, *, strict: bool) -> None:
        """Write the leased blocks down, all at once (a network tier pays one
        round trip, not one per block), then drop the internal lease once every
        write ended. strict: raise the first failure (write-through
        acknowledges durability)."""
        try:
            done = await asyncio.gather(*(self._flush_block(b, tier, strict)
                                          for b in list(lease.blocks)), return_exceptions=True)
        finally:
            self.ledger.release_internal(lease, self.clock())
        failed = next((r for r in done if isinstance(r, BaseException)), None)
        if failed is not None:
            raise failed

    async def _flush_block(self, b: Block, tier: _Tier, strict: bool) -> None:
        ns = b.ns
        book = self.ledger.lower[tier.name]
        try:
            res = book.reserve(ns.id, b.key, ns.block_bytes, b.hits, admit=not strict)
        except ResourceExhausted:
            tier.flush_failures += 1
            if strict:
                raise
            log.warning("%s tier full: block not persisted (write-back)", tier.name)
            return
        if res is None:
            return  # already below, being written, or not admitted (a full book)
        try:
            await self._forget(tier, res.evicted)
            gone = self.deletes.pending.get((tier.name, (ns.id, b.key)))
            if gone is not None:   # this key's old copy, evicted by another flush
                await gone.wait()
            await tier.write_block(self.host, self._host_loc(b),
                                   tier.loc(ns.id, b.key, ns.block_bytes), b.checksum)
        except TierError as e:
            book.failed(res.entry)
            tier.flush_failures += 1
            refusal = tier.refusal(e) if strict else None
            if refusal is not None:
                raise refusal from e
            self._unflushed.log("%s flush failed: %s", tier.name, e)
            return
        except BaseException:
            book.failed(res.entry)   # never left WRITING: the key can be written again
            raise
        book.written(res.entry)
        if not tier.keeps_book:
            book.forget(res.entry)

    async def _forget(self, tier: _Tier, evicted: Sequence[Where]) -> None:
        """Delete the copies a reservation evicted. Each is marked before the
        first await, so a flush that reserves one of those keys meanwhile
        waits for the delete (_flush_block) instead of racing it."""
        if not evicted:
            return
        marks, done = self.deletes.begin(tier.name, evicted)
        try:
            for w in evicted:
                await tier.forget(w)
        finally:
            self.deletes.end(marks, done)
