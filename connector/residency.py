"""Residency reports: what this engine's own KV cache holds, told to the daemon.

vLLM 0.32 hands a scheduler-side connector its block pool
(bind_gpu_block_pool). The pool's KV cache events (BlockStored: full blocks
cached; BlockRemoved: evicted or reused; AllBlocksCleared: the prefix cache
reset) are what this reports, batched, as kvkeeper keys, with
ReportResidency (proto/kvkeeper/v1/residency.proto) on each TP rank's
session.

* The scheduler thread does little more than before: the pool's
  take_events, which vLLM's scheduler calls once per step, is wrapped to
  also hand the step's events to this reporter (a list appended to a
  queue), and each new request's seeds go on the same queue (`seen`, from
  the connector's on_new_request). When vLLM itself has KV
  events off, they are switched on in the pool and vLLM is handed none, as
  before. The reporter then submits one job to rank 0's link thread, unless
  one is queued already: at most one report per rank per step, usually
  fewer, never a wait on the scheduler thread. A report is one job on the
  link's thread, queued like a lookup (what comes meanwhile goes in the next
  job, queued behind), so a lookup waits behind at most one report.
* That job maps vLLM's block hashes to kvkeeper keys: a BlockStored names
  its parent's hash and the new blocks' tokens, so each key is the chain
  rule of client/keys.py over its parent's key, or over the request's seed
  for a chain's first block (from the `root` queued when the request was
  seen). Blocks of requests this connector never saw, blocks with media or
  prompt embeddings (their KV is not named by their tokens alone) and
  everything after them are never reported: a missing entry only costs a
  miss, a wrong one could name wrong KV.
* What each rank's session was told is kept (`held`); after a report fails
  or the session changes (the daemon restarted, the session expired), the
  next report sends the whole book again (cleared, then stored), so the
  daemon's book converges on the engine's cache whatever was lost.
"""
from __future__ import annotations

import collections
import hashlib
import logging
import threading
from concurrent.futures import Future
from typing import Any, Callable, Deque, Dict, List, Sequence, Tuple

from kvkeeper.client.keys import block_tokens_bytes

from .link import DaemonLink
from .sched_state import request_seed_inputs

__all__ = ["ResidencyReporter"]

log = logging.getLogger("kvkeeper.connector")

# Chain seeds kept for requests whose first block was not stored yet.
ROOTS = 8192
# Steps (and requests seen) queued at most while no report drains them.
QUEUE_ITEMS = 4096
# Keys per change and per report (a book's full resend goes in several).
CHANGE_KEYS = 4096
REPORT_KEYS = 32768

Keys = Tuple[bytes, ...]     # one key per TP rank
STORED, REMOVED, CLEARED = "stored", "removed", "cleared"


def _plain(extra: Any) -> bool:
    """Whether a block's event extra keys leave its KV named by its tokens and
    the seed: only LoRA names and the cache salt (strings), no media
    ((identifier, offset) pairs) nor prompt embeddings (digests)."""
    return extra is None or all(isinstance(x, str) for x in extra)


class ResidencyReporter:
    """One engine's residency, reported on `links` (one per TP rank)."""

    def __init__(self, links: Sequence[DaemonLink], block_tokens: int, off: bool = False) -> None:
        """off: kvkeeper_report_residency=false, nothing is reported."""
        self.off = off
        self.links = list(links)
        self.bs = block_tokens
        self.capacity = 0
        self.enabled = False
        self._queue: Deque[Tuple[str, Any]] = collections.deque()
        self._busy = False   # a report job is queued or running on rank 0's link
        self._lock = threading.Lock()
        # Link thread only, from here on.
        self._roots: "collections.OrderedDict[Any, Keys]" = collections.OrderedDict()
        self._key_of: Dict[Any, Keys] = {}
        self.held: List[Dict[bytes, None]] = [{} for _ in self.links]
        self._changes: List[List[Tuple[str, List[bytes]]]] = [[] for _ in self.links]
        self._told: List[str] = ["" for _ in self.links]   # session each rank's book went to
        self._seq = [0 for _ in self.links]
        self.reports = 0
        self.failures = 0
        self._vllm_events = True

    # ------------------------------------------------------------ scheduler thread
    def bind(self, pool: Any) -> None:
        """Take the block pool's events from now on (bind_gpu_block_pool)."""
        if self.off:
            return
        hbs = getattr(pool, "hash_block_size", self.bs)
        if hbs != self.bs:
            log.warning("kvkeeper: residency not reported: vLLM hashes blocks of %s tokens, "
                        "kvkeeper keys blocks of %d", hbs, self.bs)
            return
        self.capacity = int(pool.num_gpu_blocks)
        self._vllm_events = bool(pool.enable_kv_cache_events)
        pool.enable_kv_cache_events = True
        take = pool.take_events

        def take_events() -> List[Any]:
            events = take()
            if events:
                self.observe(events)
            return events if self._vllm_events else []

        pool.take_events = take_events
        self.enabled = True

    def seen(self, request: Any, seeds: Callable[..., Sequence[bytes]]) -> None:
        """A new request (on_new_request): its chain's first block hash and
        each rank's seed (`seeds(cache_salt, lora)`: the scheduler's
        RequestSeeds), unless its blocks' KV is not named by its tokens."""
        hashes = getattr(request, "block_hashes", None)
        if not self.enabled or not hashes or getattr(request, "prompt_embeds", None) is not None:
            return
        salt, lora, mm = request_seed_inputs(request)
        if mm:
            return
        self.root(hashes, seeds(salt, lora))

    def root(self, block_hashes: Sequence[Any], seeds: Sequence[bytes]) -> None:
        """A request's chain's first block hash and each rank's seed."""
        if self.enabled and block_hashes:
            self._queue.append(("root", (_external(block_hashes[0]), tuple(seeds))))

    def observe(self, events: List[Any]) -> None:
        """One step's events: queued, and a report submitted unless one waits."""
        if len(self._queue) >= QUEUE_ITEMS:
            # The link thread has not drained for that long (the daemon is down:
            # no job runs): forget everything rather than grow; the daemon's
            # book is cleared with the next report and fills again from here.
            self._queue.clear()
            self._queue.append(("reset", None))
        self._queue.append(("events", events))
        with self._lock:
            if self._busy:   # the job running drains this too before it ends
                return
            self._busy = True
        self.links[0].submit(self._run, "residency report").add_done_callback(self._ended)

    def _ended(self, job: "Future[Any]") -> None:
        # A job that failed (or never ran: the link is down) leaves its queue
        # to the next step's.
        if job.cancelled() or job.exception() is not None:
            with self._lock:
                self._busy = False

    # ------------------------------------------------------------ link thread
    def _run(self, client: Any) -> int:
        """Drain, report; what steps queued meanwhile goes in another job,
        queued behind whatever else waits on the link (lookups go first)."""
        self.drain()
        sent = 0
        for rank, link in enumerate(self.links):
            try:
                sent += self._send(rank, client if rank == 0 else link.client(wait=False))
            except Exception as e:  # noqa: BLE001 - the next report sends the whole book
                self.failures += 1
                self._told[rank] = ""
                log.debug("kvkeeper: residency report of rank %d failed: %s", rank, e)
        with self._lock:
            if not self._queue:
                self._busy = False
                return sent
        self.links[0].submit(self._run, "residency report").add_done_callback(self._ended)
        return sent

    def drain(self) -> None:
        """Map the queued events to per-rank changes (link thread; tests call it)."""
        while self._queue:
            what, item = self._queue.popleft()
            if what == "reset":
                self._roots.clear()
                self._key_of.clear()
                for rank in range(len(self.links)):
                    self._change(rank, CLEARED, [])
                continue
            if what == "root":
                h, seeds = item
                self._roots[h] = seeds
                self._roots.move_to_end(h)
                while len(self._roots) > ROOTS:
                    self._roots.popitem(last=False)
                continue
            for e in item:
                kind = type(e).__name__
                if kind == "BlockStored":
                    self._stored(e)
                elif kind == "BlockRemoved":
                    self._removed(e)
                elif kind == "AllBlocksCleared":
                    self._key_of.clear()
                    for rank in range(len(self.links)):
                        self._change(rank, CLEARED, [])

    def _stored(self, e: Any) -> None:
        if getattr(e, "group_idx", None) not in (None, 0) or e.block_size != self.bs:
            return
        hashes, tokens = list(e.block_hashes), e.token_ids
        if len(tokens) != len(hashes) * self.bs:
            return   # some blocks skipped (a sliding window): positions unknown
        extra = list(getattr(e, "extra_keys", None) or [None] * len(hashes))
        if e.parent_block_hash is None:
            prev = self._roots.get(hashes[0]) if hashes else None
        else:
            prev = self._key_of.get(e.parent_block_hash)
        if prev is None:
            return
        new: List[List[bytes]] = [[] for _ in self.links]
        bs = self.bs
        for j, h in enumerate(hashes):
            if not _plain(extra[j] if j < len(extra) else None):
                break
            data = block_tokens_bytes(tokens[j * bs:(j + 1) * bs])
            prev = tuple(hashlib.sha256(p + data).digest() for p in prev)
            self._key_of[h] = prev
            for rank, k in enumerate(prev):
                new[rank].append(k)
        for rank, keys in enumerate(new):
            if keys:
                self._change(rank, STORED, keys)

    def _removed(self, e: Any) -> None:
        if getattr(e, "group_idx", None) not in (None, 0):
            return
        gone: List[List[bytes]] = [[] for _ in self.links]
        for h in e.block_hashes:
            keys = self._key_of.pop(h, None)
            if keys is not None:
                for rank, k in enumerate(keys):
                    gone[rank].append(k)
        for rank, keys in enumerate(gone):
            if keys:
                self._change(rank, REMOVED, keys)

    def _change(self, rank: int, kind: str, keys: List[bytes]) -> None:
        """Record a change of rank's book, to be sent (unless the whole book is)."""
        held = self.held[rank]
        if kind == STORED:
            for k in keys:
                held.pop(k, None)
                held[k] = None
            # The daemon keeps at most capacity blocks, oldest out: so does this copy.
            while self.capacity and len(held) > self.capacity:
                del held[next(iter(held))]
        elif kind == REMOVED:
            for k in keys:
                held.pop(k, None)
        else:
            held.clear()
        if self._told[rank]:   # else the next report sends the whole book anyway
            self._changes[rank].append((kind, keys))

    def _send(self, rank: int, client: Any) -> int:
        """Report rank's changes (or, to a session not told yet, its whole
        book); the RPCs it took."""
        changes, self._changes[rank] = self._changes[rank], []
        sid = client.session_id
        if sid != self._told[rank]:
            book = list(self.held[rank])
            changes = [(CLEARED, [])] + [
                (STORED, book[i:i + CHANGE_KEYS])
                for i in range(0, len(book), CHANGE_KEYS)]
            self._seq[rank] = 0
        if not changes:
            return 0
        rpcs = 0
        for batch in _reports(changes):
            self._seq[rank] += 1
            _, used = client.report_residency(batch, capacity_blocks=self.capacity,
                                              report_seq=self._seq[rank])
            rpcs += 1
            if used != sid:   # registered again meanwhile: that session gets the whole book
                raise RuntimeError("the session changed while reporting")
        self._told[rank] = sid
        self.reports += rpcs
        return rpcs


def _reports(changes: List[Tuple[str, List[bytes]]]) -> List[List[Tuple[str, List[bytes]]]]:
    """Changes in reports of at most REPORT_KEYS keys, each change at most CHANGE_KEYS."""
    out: List[List[Tuple[str, List[bytes]]]] = [[]]
    n = 0
    for kind, keys in changes:
        pieces = [keys[i:i + CHANGE_KEYS] for i in range(0, len(keys), CHANGE_KEYS)] or [keys]
        for piece in pieces:
            if out[-1] and n + len(piece) > REPORT_KEYS:
                out.append([])
                n = 0
            out[-1].append((kind, piece))
            n += len(piece)
    return out


def _external(h: Any) -> Any:
    """A request's block hash as KV events name it (vLLM's maybe_convert_block_hash)."""
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash

    return maybe_convert_block_hash(h)
