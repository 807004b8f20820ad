"""Fetching: each load's blocks found under a lease, ready to be copied in.

The scheduler's leased Match returned where the blocks lie in the daemon's
shared-memory arena (LoadSpec.refs); where this worker maps the same arena
it needs no RPC (the scheduler's lease keeps the blocks there until the
load is reported), else it matches the keys under its own lease, in one
round trip that returns the same (Match, blocks=True). Without a mapped
arena (another host, or kvkeeper_transport=stream) the lease is streamed
into the KV cache right here (stream.py), and the load is done.
"""
from __future__ import annotations

import logging
import time
from typing import Any, Callable, List, Optional, Sequence, Tuple

from kvkeeper.client import KVKeeperClientError
from kvkeeper.client.copies import Stored, stored

from ..blocks import block_sources
from ..link import DaemonLink
from ..metadata import LoadSpec
from ..releaser import Releaser
from .copy_in import BlockLoader
from .step import FetchedLoad, LoadResults
from .stream import load_streamed
from .timings import LoadTimings

__all__ = ["Fetcher"]

log = logging.getLogger("kvkeeper.connector")


class Fetcher:
    """Fetches the loads of TP rank `rank` through `link`."""

    def __init__(self, link: DaemonLink, rank: int, loader: BlockLoader, results: LoadResults,
                 releaser: Optional[Releaser]) -> None:
        self._link = link
        self._rank = rank
        self._loader = loader
        self._results = results
        self._releaser = releaser
        # Loads from a same-host peer's cache (peer/source.py), when this worker has peers.
        self.peer: Optional[Callable[[LoadSpec], None]] = None

    def fetch_all(self, loads: Sequence[LoadSpec], timings: LoadTimings) -> List[FetchedLoad]:
        """Match every load under a lease; the ones that can be copied from the
        arena come back, the others are done (streamed, or failed) here."""
        out: List[FetchedLoad] = []
        for spec in loads:
            try:
                f = self._fetch(spec, timings)
            except Exception as e:  # noqa: BLE001 - never into vLLM: recompute instead
                log.warning("kvkeeper: loading %d block(s) of %s failed: %s", spec.num_blocks(),
                            spec.req_id, e, exc_info=not isinstance(e, KVKeeperClientError))
                self._results.finish(spec, 0)
                continue
            if f is not None:
                out.append(f)
        return out

    def _fetch(self, spec: LoadSpec, timings: LoadTimings) -> Optional[FetchedLoad]:
        rank = self._rank
        keys = list(spec.keys[rank]) if rank < len(spec.keys) else []
        n = spec.num_blocks()
        if not keys or len(keys) != n:
            self._results.finish(spec, 0)
            return None
        if spec.peer is not None:
            if self.peer is None:
                self._results.finish(spec, 0)
            else:
                self.peer(spec)   # copied, checked and reported there
            return None
        f = self._fetch_by_refs(spec)
        if f is not None:
            return f
        if self._stream_matching(spec, keys, timings):
            return None
        # report_use: the scheduler reports this load with its own lookup.
        res = self._link.call(lambda c: c.match(keys, lease=True, blocks=True, report_use=True),
                              "load")
        if not res.matched or not res.lease_id:
            self._results.finish(spec, 0)
            return None
        m = min(res.matched, n)
        streamed = False   # _load_streamed releases the lease itself
        try:
            views = None
            refs = stored(res.blocks[:m])
            if len(refs) >= m:
                views = self._link.call(lambda c: c.arena_views(refs), "load")
            if views is None:
                streamed = True
                good, bad = self._load_streamed(spec, res.lease_id, m, timings)
                self._results.finish(spec, good, bad)
                return None
            return self._fetched(spec, res.lease_id, refs, views)
        except BaseException:
            if not streamed and self._releaser is not None:
                self._releaser.release(res.lease_id)
            raise

    def _fetch_by_refs(self, spec: LoadSpec) -> Optional[FetchedLoad]:
        """The load without an RPC: the scheduler's leased Match said where the
        blocks lie, and its lease keeps them there until this load is
        reported. None when that cannot be used here (no refs, another arena)."""
        rank = self._rank
        refs = spec.refs[rank] if rank < len(spec.refs) else ()
        arena = spec.arena_ids[rank] if rank < len(spec.arena_ids) else None
        if not refs or len(refs) != spec.num_blocks() or arena is None:
            return None

        def views(c: Any) -> Optional[List[List[memoryview]]]:
            return c.arena_views(refs) if c.arena_id == arena else None

        v = self._link.call(views, "load")
        return self._fetched(spec, None, refs, v) if v is not None else None

    def _fetched(self, spec: LoadSpec, lease_id: Optional[int], refs: Sequence[Stored],
                 views: List[List[memoryview]]) -> FetchedLoad:
        """A load ready to copy: its blocks' arena views, and the last block
        already copied and checked if the forward writes into it. `refs`: the
        blocks' (checksum_algo, checksum, extents) (LoadSpec.refs')."""
        loader = self._loader
        m = len(refs)
        sources = block_sources(views, loader.codec.block_bytes)
        sums = [(algo, checksum) for algo, checksum, _ in refs]
        f = FetchedLoad(spec, lease_id, m, sources, sums,
                        [v[0] if len(v) == 1 else None for v in views])
        if spec.recomputes_last and m == spec.num_blocks():
            # The forward writes the prompt's last token into this block, and
            # its recomputed KV may differ from the stored one in the last
            # bits: copy and check the block before the forward, not beside it.
            last = m - 1
            loader.copy_check_in(f, last, m)
            f.copy_n = last
        return f

    def _stream_matching(self, spec: LoadSpec, keys: List[bytes], timings: LoadTimings) -> bool:
        """Without a mapped arena: match and stream in one call (a keyed
        LoadStream: a round trip less). False where the daemon does not
        know it; the load is done (loaded, or failed: raised) otherwise."""
        loader = self._loader

        def run(c: Any) -> Optional[Tuple[int, List[int]]]:
            if c.transport != "stream":
                return None
            t0 = time.perf_counter()
            ks = c.stream_matching(keys)
            if ks is None:
                return None
            if not ks.lease_id:
                return 0, []
            bad: List[int] = []
            try:
                m = min(ks.matched, spec.num_blocks())
                good, bad = load_streamed(c, loader.codec, ks.lease_id, spec.block_ids[:m],
                                          loader.block_ok, timings, chunks=ks.chunks)
                timings.stream = time.perf_counter() - t0
                loader.count_corrupt(spec.req_id, bad)
                return good, bad
            finally:
                if self._releaser is not None:
                    self._releaser.release(ks.lease_id, discard_indices=bad)

        done = self._link.call(run, "load")
        if done is None:
            return False
        self._results.finish(spec, *done)
        return True

    def _load_streamed(self, spec: LoadSpec, lease_id: int, n: int,
                       timings: LoadTimings) -> Tuple[int, List[int]]:
        """Stream the lease's first n blocks into the KV cache, each checked
        there as it arrives; (leading blocks loaded, positions found corrupt)."""
        loader = self._loader
        bad: List[int] = []
        try:
            t0 = time.perf_counter()
            good, bad = self._link.call(
                lambda c: load_streamed(c, loader.codec, lease_id, spec.block_ids[:n],
                                        loader.block_ok, timings),
                "load")
            timings.stream = time.perf_counter() - t0
            loader.count_corrupt(spec.req_id, bad)
        finally:
            if self._releaser is not None:
                self._releaser.release(lease_id, discard_indices=bad)
        return good, bad
