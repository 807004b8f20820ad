"""WorkerPeer: a worker's peer side (holder and source), built in register_kv_caches.

prepare() runs first, before the connector's codec reads the KV tensors'
addresses: it moves the cache into shared memory (share.py). Then the
holder registers it with the daemon and the source loads peers' blocks.
Only on vLLM's CPU layout (every layer one span of host memory per block),
at TP 1, with the daemon on a unix socket; anything else logs why and
leaves the worker as it was.
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, Mapping, Optional, Sequence

import torch

from kvkeeper.client.peer import PeerClient

from ..blocks import BlockCodec
from ..config import ConnectorConfig
from ..io_thread import IoThread
from ..link import DaemonLink
from ..metadata import LoadSpec, SaveSpec
from ..stats import Counters
from .gens import Generations, gens_path
from .holder import PeerHolder
from .sched import peer_socket_for
from .share import PeerUnsupported, SharedKV, descriptor, share_kv_storage
from .source import PeerSource

__all__ = ["WorkerPeer"]

log = logging.getLogger("kvkeeper.connector")


class WorkerPeer:
    @staticmethod
    def prepare(cfg: Optional[ConnectorConfig], kv_caches: Mapping[str, torch.Tensor],
                layer_names: Sequence[str], tp_size: int) -> Optional[SharedKV]:
        """The KV cache moved into shared memory, where peers are on and it can be."""
        if cfg is None or not cfg.peer:
            return None
        why = None
        if tp_size != 1:
            why = "tensor parallelism"
        elif peer_socket_for(cfg.url) is None:
            why = "the daemon is not on a unix socket"
        if why is None:
            try:
                return share_kv_storage(kv_caches, layer_names)
            except (PeerUnsupported, OSError, RuntimeError) as e:
                why = str(e)
        log.warning("kvkeeper: kvkeeper_peer is on but this KV cache is not shared with "
                    "peers: %s", why)
        return None

    def __init__(self, cfg: ConnectorConfig, link: DaemonLink, io: IoThread, engine: str,
                 shared: SharedKV, codec: BlockCodec, num_blocks: int, counters: Counters,
                 finish: Callable[[LoadSpec, int], None]) -> None:
        spans = codec.flat_spans()
        if spans is None:
            raise PeerUnsupported("the KV cache's layers are not one span per block")
        sock = peer_socket_for(cfg.url)
        assert sock is not None
        desc = descriptor(shared, spans, num_blocks, codec.block_bytes, codec.layout.layer_bytes)
        gens, rw = Generations.open_named(gens_path(engine), num_blocks)
        try:
            ro = os.open(f"/proc/self/fd/{rw}", os.O_RDONLY | os.O_CLOEXEC)
        finally:
            os.close(rw)
        self.holder = PeerHolder(link, PeerClient(sock, cfg.io_timeout_s), io, engine, shared,
                                 desc, gens, ro)
        self.source = PeerSource(link, PeerClient(sock, cfg.lookup_timeout_s), codec, counters,
                                 finish, self.holder.note)
        self._rank = 0
        self.holder.start()

    def note_saves(self, saves: Sequence[SaveSpec]) -> None:
        """The blocks this step's forward filled (vLLM's thread, after it)."""
        self.source.trim()
        for spec in saves:
            keys = spec.keys[self._rank] if spec.keys else ()
            if len(keys) == spec.num_blocks():
                self.holder.note(keys, spec.block_ids)

    def note_load(self, spec: LoadSpec, good: int) -> None:
        keys = spec.keys[self._rank] if spec.keys else ()
        if good and len(keys) >= good:
            self.holder.note(keys[:good], spec.block_ids[:good])

    def close(self) -> None:
        self.source.close()
        self.holder.close()
