"""BlockLoader: fetched blocks copied from the arena into the KV cache and
checked on the host side of the copy.

A copied block is checked by hashing, in one pass, the bytes it was copied
from (its arena view, or the received message), right after the copy and
before vLLM may use the block. `kvkeeper bench checksum` and a 25 MB load
of a 6-layer model measured this one-shot hash of the contiguous source at
~15 GB/s, while hashing the copy back out of the KV cache, one layer's
piece at a time (what the KV tensors' layout allows), cost as much as the
copy itself. A byte changed in the arena before or during the copy differs
from what the hash reads only if it was changed back before the hash, and a
KV cache on a device is never read back to check it. Without a source (a
caller's own check) the block is hashed from the KV cache.

The pieces every load strategy is made of: copying a range of a load's
blocks in (every layer, or one layer of every load), checking a range
against the checksums they were committed with, and releasing the step's
leases once nothing reads the arena views any more.
"""
from __future__ import annotations

import logging
import time
from typing import Any, List, Optional, Sequence, Tuple

import torch

from kvkeeper.client.checksum import Hasher, can_verify, checksum
from kvkeeper.v1 import kvkeeper_pb2 as pb

from ..blocks import BlockCodec
from ..releaser import Releaser
from ..stats import Counters
from .step import FetchedLoad, StepLoads

__all__ = ["BlockLoader"]

log = logging.getLogger("kvkeeper.connector")


class BlockLoader:
    """Copies and checks for one TP rank's KV cache."""

    def __init__(self, codec: BlockCodec, verify: bool, counters: Counters,
                 releaser: Optional[Releaser]) -> None:
        self.codec = codec
        self._verify = verify   # kvkeeper_checksum != none
        self._counters = counters
        self._releaser = releaser
        # KV cache on CUDA: the strategy (gpu/load.py) copies single blocks, checked first.
        self.device: Optional[Any] = None

    def block_ok(self, block_id: int, expected: Tuple[int, int],
                 source: Optional[torch.Tensor] = None) -> bool:
        """Whether vLLM block `block_id` matches the checksum it was committed
        with: hashed over `source`, the block's bytes it was just copied from,
        where given, else read back from the KV cache."""
        algo, want = expected
        if not self._verify or algo == pb.CHECKSUM_NONE:
            return True   # checks off here, or stored without a checksum
        if not can_verify(algo):
            return False  # an algorithm this process lacks: unverified KV is never used
        if source is not None:
            return checksum(algo, source.numpy()) == want
        return self.codec.block_checksum(block_id, algo) == want

    def fetched_ok(self, f: FetchedLoad, i: int) -> bool:
        """Whether block i of f, just copied in, matches its committed checksum
        (hashed over the bytes it was copied from: its arena view)."""
        view = f.views[i] if f.views is not None else None
        if view is not None:
            algo, want = f.sums[i]
            if not self._verify or algo == pb.CHECKSUM_NONE:
                return True
            return can_verify(algo) and checksum(algo, view) == want
        src = f.sources[i] if f.sources is not None else None
        return self.block_ok(f.spec.block_ids[i], f.sums[i], src)

    def copy_in(self, f: FetchedLoad, lo: int, hi: int) -> None:
        """Copy blocks lo..hi-1 of f, every layer, from the arena into the KV cache."""
        assert f.sources is not None
        if self.device is not None:
            self.device.copy_in(f, lo, hi)
            return
        for i in range(self.codec.num_layers):
            self.codec.copy_layer_in(i, f.spec.block_ids[lo:hi], f.sources[lo:hi])

    def copy_check_in(self, f: FetchedLoad, lo: int, hi: int) -> List[int]:
        """Copy blocks lo..hi-1 of f in and check them, a block at a time (its
        source is still in the cache when it is hashed: one pass over memory
        instead of two); the ones that fail their checksum."""
        assert f.sources is not None
        codec, ids, sources = self.codec, f.spec.block_ids, f.sources
        for i in range(lo, hi):
            codec.copy_block_in(ids[i], sources[i])
            if i not in f.checked:
                f.checked[i] = self.fetched_ok(f, i)
        return [i for i in range(lo, hi) if not f.checked[i]]

    def bad_in(self, f: FetchedLoad, lo: int, hi: int) -> List[int]:
        """Blocks lo..hi-1 of f, copied in, that fail their checksum."""
        return [i for i in range(lo, hi)
                if not f.checked.get(i, True) or
                (i not in f.checked and not self.fetched_ok(f, i))]

    def check(self, f: FetchedLoad) -> None:
        """Check the copied blocks; f.good = leading good ones."""
        self.set_bad(f, self.bad_in(f, 0, f.n))

    def set_bad(self, f: FetchedLoad, bad: List[int]) -> None:
        f.bad = bad
        f.good = bad[0] if bad else f.n
        self.count_corrupt(f.spec.req_id, bad)

    def count_corrupt(self, req_id: str, bad: Sequence[int]) -> None:
        if bad:
            self._counters.inc("checksum_errors", len(bad))
            log.warning("kvkeeper: %d block(s) of %s failed their checksum; they are dropped "
                        "from the daemon and recomputed", len(bad), req_id)

    def release(self, step: StepLoads) -> None:
        """Drop the arena views, then release each load's lease, discarding its
        corrupt blocks (a load by the scheduler's refs has no lease here).
        Once per step: a step that broke may be released by whoever gets there."""
        if step.released:
            return
        step.released = True
        for f in step.fetched:
            f.sources = f.views = None
            if self._releaser is not None:
                self._releaser.release(f.lease_id, discard_indices=f.bad)

    def copy_and_check(self, step: StepLoads) -> None:
        """Copy every fetched block in and check it, then release the leases:
        layer by layer when a layer's attention waits for it (setting each
        layer's event as it is in; each block's layer piece is hashed right
        after its copy, while it is in cache, instead of a second pass over
        every block after the last layer), else a block at a time
        (copy_check_in)."""
        if not step.layer_done:
            self._blockwise(step)
            return
        codec = self.codec
        t0 = time.perf_counter()
        lb = codec.layout.layer_bytes
        hashers: List[List[Tuple[Hasher, memoryview]]] = [[] for _ in step.fetched]
        try:
            hashers = [self._hashers(f) for f in step.fetched]
            for i, name in enumerate(codec.layer_names):
                if step.abandoned:   # reported failed meanwhile: write no more (worker._stop)
                    break
                lo, hi = i * lb, (i + 1) * lb
                for f, hs in zip(step.fetched, hashers):
                    if f.sources and f.copy_n:
                        codec.copy_layer_in(i, f.spec.block_ids[:f.copy_n],
                                            f.sources[:f.copy_n])
                        # Each block's layer piece hashed while it is in cache.
                        for h, v in hs:
                            h.feed(v[lo:hi])
                ev = step.layer_done.get(name)
                if ev is not None:
                    ev.set()
        except Exception as e:  # noqa: BLE001
            log.warning("kvkeeper: copying loaded blocks into the KV cache failed: %s", e,
                        exc_info=True)
            step.abandoned = True
        finally:
            for ev in step.layer_done.values():
                ev.set()
        t1 = time.perf_counter()
        step.timings.copy = t1 - t0
        for f, hs in zip(step.fetched, hashers):
            if not step.abandoned:
                for j, (h, _) in enumerate(hs):
                    f.checked[j] = h.digest() == f.sums[j][1]
                try:
                    self.check(f)
                except Exception as e:  # noqa: BLE001
                    log.warning("kvkeeper: checking loaded blocks of %s failed: %s",
                                f.spec.req_id, e, exc_info=True)
                    f.good = 0
        self.release(step)
        step.timings.check = time.perf_counter() - t1

    def _hashers(self, f: FetchedLoad) -> List[Tuple[Hasher, memoryview]]:
        """Per block copied layer by layer (the leading f.copy_n, each in
        order): a Hasher of its committed algorithm and its arena view, for
        the blocks checked that way (one view; not checked already)."""
        if not self._verify or f.views is None or not f.sources:
            return []
        out = []
        for j in range(f.copy_n):
            algo = f.sums[j][0]
            v = f.views[j]
            if v is None or j in f.checked or algo == pb.CHECKSUM_NONE or not can_verify(algo):
                return out   # the rest are checked after the copy, as before
            out.append((Hasher(algo), v))
        return out

    def _blockwise(self, step: StepLoads) -> None:
        t0 = time.perf_counter()
        for f in step.fetched:
            if step.abandoned:   # reported failed meanwhile: write no more (worker._stop)
                break
            try:
                bad = self.copy_check_in(f, 0, f.copy_n) if f.sources and f.copy_n else []
                self.set_bad(f, bad + self.bad_in(f, f.copy_n, f.n))
            except Exception as e:  # noqa: BLE001 - a failed copy: recompute all of it
                log.warning("kvkeeper: copying loaded blocks of %s into the KV cache failed: "
                            "%s", f.spec.req_id, e, exc_info=True)
                step.abandoned = True
        self.release(step)
        step.timings.copy = step.timings.check = time.perf_counter() - t0
