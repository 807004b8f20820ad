"""The daemon's peer socket end to end (in-process daemon, real descriptors):
registration with SCM_RIGHTS, publish, a peer's lookup and its read-only
descriptors, refusals, and the segment forgotten when its session ends."""
from __future__ import annotations

import asyncio
import mmap
import os
from typing import Any, Tuple

import numpy as np
import pytest

from kvkeeper.client import AsyncClient
from kvkeeper.client.peer import PeerClient, PeerError
from kvkeeper.client.peer_segment import ATTACHED, DESCRIPTOR_VERSION, attached_slot, gens_bytes
from kvkeeper.client.peer_wire import peer_socket_path

N, LB = 4, 256
NS = {"model_id": "peer-test", "dtype": "float32", "block_tokens": 16, "block_bytes": 2 * LB}


def segment(attached: bool = True) -> Tuple[int, int, Any, dict]:
    """A holder's KV memfd (block b of layer l filled with 16*l + b) and its generations."""
    kv = os.memfd_create("kv")
    os.ftruncate(kv, 2 * N * LB)
    gens = os.memfd_create("gens")
    os.ftruncate(gens, gens_bytes(N))
    with mmap.mmap(kv, 2 * N * LB) as m:
        for layer in range(2):
            for b in range(N):
                off = layer * N * LB + b * LB
                m[off:off + LB] = bytes([16 * layer + b]) * LB
    g = np.frombuffer(mmap.mmap(gens, gens_bytes(N)), dtype=np.uint64)
    if attached:
        g[attached_slot(N)] = ATTACHED
    desc = {"version": DESCRIPTOR_VERSION, "num_blocks": N, "block_bytes": 2 * LB,
            "layer_bytes": LB, "kv_bytes": 2 * N * LB, "layers": [[0, LB], [N * LB, LB]]}
    return kv, gens, g, desc


async def call(fn: Any, *a: Any) -> Any:
    # The blocking client must not block the loop the daemon runs on.
    return await asyncio.to_thread(fn, *a)


async def test_a_peer_gets_the_holders_blocks_until_its_session_ends(daemon: Any) -> None:
    url = f"unix:{daemon.socket_path}"
    holder = await AsyncClient.connect(url, NS, instance_id="holder")
    peer = await AsyncClient.connect(url, NS, instance_id="peer")
    other = await AsyncClient.connect(url, {**NS, "model_id": "other"}, instance_id="other")
    path = peer_socket_path(daemon.socket_path)
    assert oct(os.stat(path).st_mode & 0o777) == oct(daemon.config.listen.socket_mode & 0o777)
    hc, pc = PeerClient(path), PeerClient(path)
    kv, gens_fd, gens, desc = segment()
    try:
        seg = await call(hc.register, holder.session_id, "engine-a", desc, kv, gens_fd)
        keys = [bytes([i]) * 32 for i in range(3)]
        assert await call(hc.publish, holder.session_id, seg,
                          [(k, b, 0) for k, b in zip(keys, (2, 0, 3))]) == 3
        m = await call(pc.match, peer.session_id, "engine-b", keys + [b"\x09" * 32])
        assert m.segment == seg and m.blocks == ((2, 0), (0, 0), (3, 0))
        text = daemon.metrics.render().decode()
        for line in ("kvkeeper_peer_segments 1.0", "kvkeeper_peer_published_blocks 3.0",
                     "kvkeeper_peer_lookups_total 1.0", "kvkeeper_peer_lookup_hit_blocks_total 3.0"):
            assert line in text, line
        assert (await call(pc.match, peer.session_id, "engine-a", keys)).matched == 0
        assert (await call(pc.match, other.session_id, "engine-b", keys)).matched == 0
        got, fds = await call(pc.get, peer.session_id, seg)
        try:
            assert got == desc and len(fds) == 2
            with mmap.mmap(fds[0], 2 * N * LB, prot=mmap.PROT_READ) as m2:
                assert m2[N * LB + 3 * LB] == 16 + 3   # layer 1, block 3: the holder's bytes
        finally:
            for fd in fds:
                os.close(fd)
        gens[2] = 1   # block 2 reused: the chain now stops before it
        assert (await call(pc.match, peer.session_id, "engine-b", keys)).matched == 0
        with pytest.raises(PeerError) as e:
            await call(pc.get, other.session_id, seg)
        assert e.value.not_found
        await holder.close()
        with pytest.raises(PeerError) as e:
            await call(pc.get, peer.session_id, seg)
        assert e.value.not_found
        assert daemon.peer.registry.segments == {}
    finally:
        hc.close()
        pc.close()
        os.close(kv)
        os.close(gens_fd)
        await peer.close()
        await other.close()


async def test_refusals_keep_the_connection_and_change_nothing(daemon: Any) -> None:
    url = f"unix:{daemon.socket_path}"
    holder = await AsyncClient.connect(url, NS, instance_id="holder")
    c = PeerClient(peer_socket_path(daemon.socket_path))
    kv, gens_fd, _, desc = segment()
    try:
        for bad, fds, why in [
                ({**desc, "kv_bytes": 1}, (kv, gens_fd), "kv_bytes"),
                (desc, (kv,), "2 descriptors"),
                ({**desc, "num_blocks": 1 << 20}, (kv, gens_fd), "does not fit")]:
            with pytest.raises(PeerError, match=why):
                await call(c.call, {"op": "register", "session": holder.session_id,
                                    "engine": "e", "descriptor": bad}, fds)
        with pytest.raises(PeerError, match="unknown session"):
            await call(c.register, "1-deadbeef", "e", desc, kv, gens_fd)
        with pytest.raises(PeerError, match="unknown peer op"):
            await call(c.call, {"op": "nope", "session": holder.session_id})
        with pytest.raises(PeerError, match="not registered"):
            await call(c.publish, holder.session_id, "abc", [(b"k" * 32, 0, 0)])
        assert daemon.peer.registry.segments == {}
        seg = await call(c.register, holder.session_id, "e", desc, kv, gens_fd)
        assert list(daemon.peer.registry.segments) == [seg]
    finally:
        c.close()
        os.close(kv)
        os.close(gens_fd)
        await holder.close()
