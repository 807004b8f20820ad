"""The scheduler's part in peer sharing: generations bumped on reuse, and peer lookups.

Holder: vLLM's scheduler hands a block out again only through
BlockPool.get_new_blocks, in schedule(), before the step that writes the
block is sent to the workers; wrapping that method to bump each returned
block's generation (gens.py) therefore moves the counter before any write
(the forward's, a load's, vLLM's zeroing of new blocks). Once wrapped the
array is marked attached: before that, nothing this engine published may be
copied (the daemon skips it).

Peer: a lookup whose Match found fewer blocks in the daemon than the prompt
has asks the peer socket which other engine holds a longer prefix, on the
same thread and within the same deadline (a miss if it does not answer).
"""
from __future__ import annotations

import logging
import os
from typing import Any, Callable, List, Optional

from kvkeeper.client.peer import PeerClient, PeerError, PeerMatch
from kvkeeper.client.peer_wire import peer_socket_path
from kvkeeper.client.url import parse_url

from .gens import Generations, gens_path

__all__ = ["SchedulerPeer", "peer_socket_for"]

log = logging.getLogger("kvkeeper.connector")


def peer_socket_for(url: str) -> Optional[str]:
    """The daemon's peer socket for a daemon URL; None over TCP (not the same host)."""
    u = parse_url(url)
    return peer_socket_path(os.path.abspath(u.path)) if u.kind == "unix" and u.path else None


class SchedulerPeer:
    def __init__(self, socket_path: str, engine: str, num_blocks: int, timeout: float,
                 shm_dir: Optional[str] = None) -> None:
        self.engine = engine
        self.client = PeerClient(socket_path, timeout)
        path = gens_path(engine) if shm_dir is None else gens_path(engine, shm_dir)
        # The workers created it when they registered their caches (before
        # vLLM built this scheduler); its name is not needed any more.
        self.gens, fd = Generations.open_named(path, num_blocks)
        os.close(fd)
        try:
            os.unlink(path)
        except OSError:
            pass
        self.lookups = 0
        self.hits = 0

    def bind_block_pool(self, pool: Any) -> None:
        """Bump the generation of every block `pool` hands out from now on."""
        original: Callable[[int], List[Any]] = pool.get_new_blocks
        gens = self.gens

        def get_new_blocks(num_blocks: int) -> List[Any]:
            blocks = original(num_blocks)
            gens.bump([b.block_id for b in blocks])
            return blocks

        pool.get_new_blocks = get_new_blocks
        gens.attach()
        log.info("kvkeeper: this engine's KV cache is shared with same-host peers "
                 "(block reuse bumps generations)")

    def match(self, client: Any, keys: List[bytes], host_matched: int) -> Optional[PeerMatch]:
        """A peer's hit longer than the daemon's `host_matched` blocks, or None."""
        if host_matched >= len(keys):
            return None
        self.lookups += 1
        try:
            m = self.client.match(client.session_id, self.engine, keys)
        except PeerError as e:
            log.debug("kvkeeper: peer lookup failed: %s", e)
            return None
        if m.matched <= host_matched:
            return None
        self.hits += 1
        return m

    def close(self) -> None:
        self.gens.detach()
        self.gens.close()
        self.client.close()
