"""Peer loads: blocks copied straight from another engine's KV cache into ours.

The scheduler's lookup found the prompt's prefix in a same-host peer's
cache, not in the daemon's tiers (LoadSpec.peer: the peer's segment and
each block's (block, generation) there). The worker maps that segment
read-only, once (the daemon hands over its descriptors: client/peer.py),
and copies the blocks in layer by layer, as a host hit does, with one
memmove per block and layer from the holder's layer to ours. The copy is
checked by the holder's generations before and after (gens.py): a block
the holder reused meanwhile, and every block after it, is reported as a
load error, so vLLM recomputes it. No lease: a peer's cache is a hint.

The copy runs before the forward, in vLLM's thread (with the fetches), so
nothing of a failed block is read by attention before its error is known.
A holder that died or hangs cannot stall it: the segment stays mapped and
readable while we map it, its generations no longer move, and a holder
whose session ended is not found at all (a miss). Mappings are kept for
at most MAX_MAPS holders and dropped once unused for IDLE_S (checked at
each step that saves or loads: a dead holder's cache stays alive while a
peer maps it), or when a copy from them failed.

KVKEEPER_TEST_PEER_PAUSE (tests only): a directory; while it holds a file
"arm", the next copy removes it, creates "paused" after the first layer
and waits up to 120 s for "go" (removing it): a test makes the holder reuse
the blocks, or kills it, in the middle of a copy.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import time
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np

from kvkeeper.client.peer import PeerClient, PeerError
from kvkeeper.client.peer_segment import check_descriptor
from kvkeeper.client.peer_wire import close_fds

from ..blocks import BlockCodec
from ..link import DaemonLink
from ..metadata import LoadSpec
from ..stats import Counters
from .gens import Generations, copy_checked

__all__ = ["HolderMap", "PeerSource", "TEST_PAUSE_ENV"]

log = logging.getLogger("kvkeeper.connector")

MAX_MAPS = 4
IDLE_S = 60.0
TEST_PAUSE_ENV = "KVKEEPER_TEST_PEER_PAUSE"
_memmove = ctypes.memmove


class HolderMap:
    """A holder's segment mapped read-only here (KV and generations)."""

    def __init__(self, desc: Dict[str, Any], kv_fd: int, gens_fd: int) -> None:
        problems = check_descriptor(desc, os.fstat(kv_fd).st_size, os.fstat(gens_fd).st_size)
        if problems:
            raise ValueError("peer segment: " + "; ".join(problems[:3]))
        self.num_blocks = int(desc["num_blocks"])
        self.layer_bytes = int(desc["layer_bytes"])
        self.layers: List[Tuple[int, int]] = [(int(o), int(s)) for o, s in desc["layers"]]
        self._kv = mmap.mmap(kv_fd, int(desc["kv_bytes"]), flags=mmap.MAP_SHARED,
                             prot=mmap.PROT_READ)
        self._bytes = np.frombuffer(self._kv, dtype=np.uint8)
        self.base = int(self._bytes.ctypes.data)
        self.gens = Generations(gens_fd, self.num_blocks, writable=False)
        self.used = time.monotonic()

    def copy_into(self, codec: BlockCodec, block_ids: Sequence[int],
                  holder_blocks: Sequence[int], after_layer: Callable[[int], None]) -> None:
        """Copy holder_blocks[i] into our vLLM block block_ids[i], layer by layer."""
        spans = codec.flat_spans()
        if spans is None or len(spans) != len(self.layers):
            raise ValueError("this KV cache's layout cannot take a peer's blocks")
        lb = self.layer_bytes
        if lb != codec.layout.layer_bytes:
            raise ValueError(f"the peer's layers hold {lb} bytes per block, ours "
                             f"{codec.layout.layer_bytes}")
        for hb in holder_blocks:
            if not 0 <= hb < self.num_blocks:
                raise IndexError(f"block {hb} is outside the peer's {self.num_blocks} blocks")
        for (dbase, dstride, dn, _), (soff, sstride), layer in zip(spans, self.layers,
                                                                   range(len(spans))):
            src0 = self.base + soff
            for bid, hb in zip(block_ids, holder_blocks):
                if not 0 <= bid < dn:
                    raise IndexError(f"block {bid} is outside the KV cache's {dn} blocks")
                _memmove(dbase + bid * dstride, src0 + hb * sstride, lb)
            after_layer(layer)

    def close(self) -> None:
        self.gens.close()
        del self._bytes
        try:
            self._kv.close()
        except BufferError:
            pass


class PeerSource:
    """The peer loads of one worker (TP rank 0's link)."""

    def __init__(self, link: DaemonLink, client: PeerClient, codec: BlockCodec,
                 counters: Counters, finish: Callable[[LoadSpec, int], None],
                 note: Callable[[Sequence[bytes], Sequence[int]], None]) -> None:
        self._link = link
        self._client = client
        self._codec = codec
        self._counters = counters
        self._finish = finish
        self._note = note
        self._maps: Dict[str, HolderMap] = {}

    def _map(self, segment: str) -> Optional[HolderMap]:
        m = self._maps.get(segment)
        if m is not None:
            return m
        try:
            desc, fds = self._client.get(self._link.session_id(), segment)
        except PeerError as e:
            log.debug("kvkeeper: peer segment %s: %s", segment[:12], e)
            return None
        try:
            m = HolderMap(desc, fds[0], fds[1])
        except (ValueError, OSError) as e:
            log.warning("kvkeeper: cannot map peer segment %s: %s", segment[:12], e)
            return None
        finally:
            close_fds(fds)   # the mappings keep what they need
        m.used = time.monotonic()
        self._maps[segment] = m
        self.trim()
        return m

    def trim(self) -> None:
        """Unmap holders unused for IDLE_S, and the least recent beyond MAX_MAPS
        (a dead holder's cache stays alive while it is mapped here)."""
        now = time.monotonic()
        for seg, m in sorted(self._maps.items(), key=lambda kv: kv[1].used):
            if len(self._maps) > MAX_MAPS or now - m.used > IDLE_S:
                self.forget(seg)

    def forget(self, segment: str) -> None:
        m = self._maps.pop(segment, None)
        if m is not None:
            m.close()

    def load(self, spec: LoadSpec) -> None:
        """Copy and check spec's blocks from the peer; report the load done."""
        assert spec.peer is not None
        segment, entries = spec.peer
        n = min(spec.num_blocks(), len(entries))
        good = 0
        try:
            m = self._map(segment) if n else None
            if m is not None:
                m.used = time.monotonic()
                hb = [int(b) for b, _ in entries[:n]]
                want = [int(g) for _, g in entries[:n]]
                ids = list(spec.block_ids[:n])
                good = copy_checked(m.gens, hb, want,
                                    lambda k: m.copy_into(self._codec, ids[:k], hb[:k],
                                                          _test_pause))
                if good < n:
                    self._counters.inc("peer_stale_blocks", n - good)
                    log.info("kvkeeper: %d of %d block(s) of %s changed in the peer's cache "
                             "during the copy; they are recomputed", n - good, n, spec.req_id)
        except Exception as e:  # noqa: BLE001 - a failed peer copy is a miss, recomputed
            log.warning("kvkeeper: copying %d block(s) of %s from a peer failed: %s", n,
                        spec.req_id, e)
            self.forget(segment)
            good = 0
        if good:
            self._counters.inc("peer_loaded_blocks", good)
            keys = spec.keys[0] if spec.keys else ()
            self._note(keys[:good], spec.block_ids[:good])
        self._finish(spec, good)

    def close(self) -> None:
        for seg in list(self._maps):
            self.forget(seg)
        self._client.close()


def _test_pause(layer: int) -> None:
    d = os.environ.get(TEST_PAUSE_ENV)
    if not d or layer != 0 or not os.path.exists(os.path.join(d, "arm")):
        return
    os.unlink(os.path.join(d, "arm"))
    open(os.path.join(d, "paused"), "w").close()
    deadline = time.monotonic() + 120.0
    go = os.path.join(d, "go")
    while not os.path.exists(go) and time.monotonic() < deadline:
        time.sleep(0.01)
    if os.path.exists(go):
        os.unlink(go)
