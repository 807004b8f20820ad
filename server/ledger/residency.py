"""The gpu tier's book: which blocks each engine's own KV cache holds now.

One EngineBook per reporting session (an engine, or one TP rank of one:
each rank has its own session and namespace). Its connector reports changes
from vLLM's block pool (ReportResidency), batched: blocks stored (with the
engine's block id of each, when known), removed, or the whole cache
cleared, applied in order. A book is made by its session's first report,
which must say the cache's capacity in blocks, and is dropped when the
session ends (closed, expired, disconnected) with a cleared event.

The daemon holds none of these bytes and cannot check them: the book is what
the engine said, and may be stale (a report lost, an engine that hung). That
only ever costs a miss: a router sends a request to an engine that no longer
holds the prefix, or a peer's load (issue 14 item 3) finds the block gone or
reused and recomputes. For the same reason a report never fails for what it
says about blocks (removing a block the book does not hold is nothing), and
a book never holds more blocks than the capacity the engine declared: past
it, the blocks held longest (the likeliest stale) leave first, counted as
`overflow`.

Every change to a book appends an event to the EventLog (events.py) of tier
"gpu" and the book's engine, which WatchEvents streams.

Sans-I/O, like the rest of the ledger; the Ledger keeps one Residency
(`ledger.residency`) and validates sessions and keys before calling in
(routing.py).
"""
from __future__ import annotations

from dataclasses import dataclass, field
from itertools import takewhile
from typing import Optional, Sequence

from ..errors import InvalidArgument
from ..ids import GPU, EngineId, NamespaceId, SessionId
from .events import CLEARED, EVENT_KINDS, REMOVED, STORED, EventLog
from .records import Session
from .sessions import tag

# The most blocks an engine's book may hold. vLLM's block ids index its KV
# cache, and 4M blocks (64M tokens of 16-token blocks) is more than any one
# engine's GPU memory holds; a book costs ~165 B a key, so one client's
# declared capacity can make the daemon hold at most ~700 MB for it (2^31,
# the int32 limit, let one session grow it by hundreds of GB).
MAX_CAPACITY_BLOCKS = 1 << 22
# A block id the engine did not say.
UNKNOWN_BLOCK = -1


@dataclass(frozen=True)
class Change:
    """One reported change: `keys` stored (with `block_ids`, one per key, or
    none) or removed, or the whole cache cleared (no keys)."""

    kind: str
    keys: Sequence[bytes] = ()
    block_ids: Sequence[int] = ()


@dataclass(eq=False)
class EngineBook:
    engine: EngineId
    session: SessionId
    instance_id: str
    namespace: NamespaceId
    block_bytes: int
    capacity_blocks: int
    # key -> the engine's block id (UNKNOWN_BLOCK when not said), oldest first.
    blocks: dict[bytes, int] = field(default_factory=dict)
    # The highest report_seq applied (reports at or below it are repeats).
    report_seq: int = 0
    reports: int = 0
    # Blocks dropped because the engine reported more than its capacity.
    overflow: int = 0
    updated_at: float = 0.0

    @property
    def resident_bytes(self) -> int:
        return len(self.blocks) * self.block_bytes

    def prefix(self, keys: Sequence[bytes]) -> int:
        """How many leading `keys` this engine holds."""
        # takewhile over the dict's own __contains__: the loop runs in C.
        return sum(1 for _ in takewhile(self.blocks.__contains__, keys))


@dataclass(frozen=True)
class ReportResult:
    engine: EngineId
    resident_blocks: int
    applied: bool          # False: a repeat of a report already applied (report_seq)


def engine_of(sid: SessionId) -> EngineId:
    """An engine's public name: its session's tag (sessions.tag), never the id."""
    return EngineId(tag(sid))


class Residency:
    """Every engine's book, by session and by namespace, and their events."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.books: dict[SessionId, EngineBook] = {}
        # namespace -> its engines' books, in the order they first reported.
        self.by_namespace: dict[NamespaceId, dict[EngineId, EngineBook]] = {}
        self.by_engine: dict[EngineId, EngineBook] = {}
        # The books as a tuple replaced on every change, never changed: what
        # the metrics thread iterates while the loop changes the dicts.
        self.engine_list: tuple[EngineBook, ...] = ()
        # Monotonic counters, read by metrics.
        self.reports = 0
        self.repeats = 0

    # ------------------------------------------------------------ reports
    def report(self, session: Session, changes: Sequence[Change], *, capacity_blocks: int,
               report_seq: int, now: float) -> ReportResult:
        """Apply one batch of `session`'s changes, in order. The keys are
        checked already (Ledger.check_keys); InvalidArgument for anything
        else wrong, with nothing changed."""
        book = self.books.get(session.id)
        _check(changes, capacity_blocks, book)
        if book is not None and report_seq and report_seq <= book.report_seq:
            self.repeats += 1
            return ReportResult(book.engine, len(book.blocks), False)
        if book is None:
            book = self._new_book(session, capacity_blocks)
        elif capacity_blocks:
            book.capacity_blocks = capacity_blocks
        log, engine, ns = self.log, book.engine, book.namespace
        blocks = book.blocks
        for c in changes:
            if c.kind == STORED:
                ids = c.block_ids or (UNKNOWN_BLOCK,) * len(c.keys)
                for k, bid in zip(c.keys, ids):
                    # Re-stored keys move to the newest end: a block vLLM caches
                    # again is fresh, whatever the book held before.
                    blocks.pop(k, None)
                    blocks[k] = bid
                if c.keys:
                    log.append(GPU, engine, STORED, ns, c.keys)
            elif c.kind == REMOVED:
                gone = [k for k in c.keys if blocks.pop(k, None) is not None]
                if gone:
                    log.append(GPU, engine, REMOVED, ns, gone)
            else:
                blocks.clear()
                log.append(GPU, engine, CLEARED, ns)
        self._trim(book)
        if report_seq:
            book.report_seq = report_seq
        book.reports += 1
        book.updated_at = now
        self.reports += 1
        return ReportResult(engine, len(blocks), True)

    def _new_book(self, session: Session, capacity_blocks: int) -> EngineBook:
        book = EngineBook(engine_of(session.id), session.id, session.instance_id, session.ns.id,
                          session.ns.block_bytes, capacity_blocks)
        self.books[session.id] = book
        self.by_engine[book.engine] = book
        self.by_namespace.setdefault(book.namespace, {})[book.engine] = book
        self.engine_list = tuple(self.books.values())
        return book

    def _trim(self, book: EngineBook) -> None:
        """Hold at most capacity_blocks: the oldest go (see the module docstring)."""
        over = len(book.blocks) - book.capacity_blocks
        if over <= 0:
            return
        it = iter(book.blocks)
        gone = [next(it) for _ in range(over)]
        for k in gone:
            del book.blocks[k]
        book.overflow += over
        self.log.append(GPU, book.engine, REMOVED, book.namespace, gone)

    # ------------------------------------------------------------ sessions
    def drop(self, sid: SessionId) -> None:
        """`sid`'s session ended: its engine's book goes, with a cleared event.
        A session that never reported changes nothing."""
        book = self.books.pop(sid, None)
        if book is None:
            return
        del self.by_engine[book.engine]
        engines = self.by_namespace[book.namespace]
        del engines[book.engine]
        if not engines:
            del self.by_namespace[book.namespace]
        self.engine_list = tuple(self.books.values())
        self.log.append(GPU, book.engine, CLEARED, book.namespace)

    # ------------------------------------------------------------ reading
    def engines(self, namespace: NamespaceId) -> list[EngineBook]:
        """The books of `namespace`'s engines, in the order they first reported."""
        return list(self.by_namespace.get(namespace, {}).values())

    def prefixes(self, namespace: NamespaceId,
                 keys: Sequence[bytes]) -> list[tuple[EngineBook, int]]:
        """Per engine of `namespace`: how many leading `keys` it holds."""
        return [(b, b.prefix(keys)) for b in self.engines(namespace)]

    def holder(self, namespace: NamespaceId, keys: Sequence[bytes],
               besides: Optional[SessionId] = None) -> tuple[Optional[EngineBook], int]:
        """The engine (other than `besides`'s) holding the longest leading run
        of `keys`, and its length; (None, 0) when none holds the first key."""
        best: Optional[EngineBook] = None
        n = 0
        for b in self.by_namespace.get(namespace, {}).values():
            if b.session == besides:
                continue
            p = b.prefix(keys)
            if p > n:
                best, n = b, p
        return best, n

    def check_invariants(self, live: "dict[SessionId, Session]") -> list[str]:
        """Problems found (empty when sound)."""
        out: list[str] = []
        indexed = {id(b) for engines in self.by_namespace.values() for b in engines.values()}
        if indexed != {id(b) for b in self.books.values()} or len(indexed) != len(self.books):
            out.append("residency: the namespace index and the books disagree")
        if {id(b) for b in self.by_engine.values()} != {id(b) for b in self.books.values()}:
            out.append("residency: the engine index and the books disagree")
        if list(self.engine_list) != list(self.books.values()):
            out.append("residency: the metrics' list of books is stale")
        for sid, b in self.books.items():
            s = live.get(sid)
            if s is None:
                out.append(f"residency: engine {b.engine} has a book but no live session")
            elif s.ns.id != b.namespace:
                out.append(f"residency: engine {b.engine} is filed under another namespace")
            if b.session != sid or b.engine != engine_of(sid):
                out.append(f"residency: book of engine {b.engine} is filed under another session")
            if not 0 < b.capacity_blocks <= MAX_CAPACITY_BLOCKS:
                out.append(f"residency: engine {b.engine} capacity {b.capacity_blocks}")
            if len(b.blocks) > b.capacity_blocks:
                out.append(f"residency: engine {b.engine} holds {len(b.blocks)} blocks over its "
                           f"capacity {b.capacity_blocks}")
            if any(i < UNKNOWN_BLOCK for i in b.blocks.values()):
                out.append(f"residency: engine {b.engine} has a negative block id")
        return out + self.log.check_invariants()


def _check(changes: Sequence[Change], capacity_blocks: int, book: Optional[EngineBook]) -> None:
    if not 0 <= capacity_blocks <= MAX_CAPACITY_BLOCKS:
        raise InvalidArgument(f"capacity_blocks {capacity_blocks} is outside "
                              f"[1, {MAX_CAPACITY_BLOCKS}]")
    if book is None and not capacity_blocks:
        raise InvalidArgument("the first residency report of a session must say its KV "
                              "cache's capacity_blocks (> 0)")
    cap = capacity_blocks or (book.capacity_blocks if book is not None else 0)
    for i, c in enumerate(changes):
        if c.kind not in EVENT_KINDS:
            raise InvalidArgument(f"change {i}: kind {c.kind!r} is none of {', '.join(EVENT_KINDS)}")
        if c.kind == CLEARED and c.keys:
            raise InvalidArgument(f"change {i}: a clear names no keys")
        if c.block_ids and (c.kind != STORED or len(c.block_ids) != len(c.keys)):
            raise InvalidArgument(f"change {i}: block_ids need a stored change with one per key "
                                  f"({len(c.block_ids)} for {len(c.keys)} keys)")
        bad = next((b for b in c.block_ids if not 0 <= b < cap), None)
        if bad is not None:
            raise InvalidArgument(f"change {i}: block id {bad} is outside the cache's "
                                  f"{cap} blocks")
