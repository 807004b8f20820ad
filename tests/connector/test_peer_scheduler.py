"""SchedulerSide with a same-host peer (no engine): a peer's longer hit is
loaded from the peer without a daemon lease, and counted as no daemon hit;
the peer is asked only when the daemon answers short."""
from __future__ import annotations

from typing import Any, List

import pytest

from connector_harness import vllm_unavailable

if vllm_unavailable() is not None:
    pytest.skip(vllm_unavailable(), allow_module_level=True)

from kvkeeper.client.peer import PeerMatch  # noqa: E402
from kvkeeper.connector.config import ConnectorConfig  # noqa: E402
from kvkeeper.connector.scheduler import SchedulerSide  # noqa: E402

from test_connector_scheduler import (TOKENS, Blocks, Clock, FakeDaemon, FakeLink,  # noqa: E402
                                      Req, Waiter, done, flush, layout, ns, output, store)


class FakePeer:
    def __init__(self, blocks: int) -> None:
        self.blocks = blocks
        self.asked: List[int] = []

    def __call__(self, client: Any, keys: List[bytes], host_matched: int) -> PeerMatch:
        self.asked.append(host_matched)
        return PeerMatch("seg", tuple((100 + i, 7) for i in range(min(self.blocks, len(keys)))))


def make(peer: FakePeer):
    d = FakeDaemon()
    clock = Clock()
    side = SchedulerSide(ConnectorConfig(url="unix:///nowhere"), layout(), [ns()],
                         [FakeLink(d)], clock=clock, wait=Waiter(clock), peer=peer)
    return side, d


def test_a_peers_longer_hit_is_loaded_from_the_peer_without_a_lease() -> None:
    peer = FakePeer(4)
    side, d = make(peer)
    store(d, 0, TOKENS, 1)
    r = Req("a", TOKENS + [5] * 10)
    assert side.get_num_new_matched_tokens(r, 0) == (128, False)
    assert peer.asked == [1]
    flush(side)
    assert [lid for lid, _ in d.released] == [1] and not d.leases, "the host lease is returned"
    side.update_state_after_alloc(r, Blocks([40, 41, 42, 43, 44]), 128)
    r.num_computed_tokens = 128
    (load,) = side.build_connector_meta(output(a=10), lambda rid: [40, 41, 42, 43, 44]).loads
    assert load.peer == ("seg", ((100, 7), (101, 7), (102, 7), (103, 7)))
    assert load.block_ids == (40, 41, 42, 43) and load.refs == ()
    assert side.hit_sources(r) == {"p2p": 128}
    side.update_connector_output(done(load.load_id, 4))
    flush(side)
    # The lookup is reported (lease 0: no daemon lease), none of it as the daemon's hit.
    assert d.reports and d.reports[-1][0] == 0 and d.reports[-1][1]["loaded_blocks"] == 0


def test_a_peer_starts_after_vllms_own_hit() -> None:
    side, d = make(FakePeer(4))
    r = Req("a", TOKENS + [5] * 10)
    assert side.get_num_new_matched_tokens(r, 64) == (64, False)   # blocks 2 and 3
    side.update_state_after_alloc(r, Blocks([40, 41, 42, 43, 44]), 64)
    (load,) = side.build_connector_meta(output(a=10), lambda rid: [40, 41, 42, 43, 44]).loads
    assert load.peer == ("seg", ((102, 7), (103, 7))) and load.block_ids == (42, 43)


def test_the_peer_is_not_used_unless_longer_and_not_asked_for_a_full_host_hit() -> None:
    peer = FakePeer(2)
    side, d = make(peer)
    store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS + [5] * 10)
    assert side.get_num_new_matched_tokens(r, 0) == (96, False)
    side.update_state_after_alloc(r, Blocks([40, 41, 42, 43, 44]), 96)
    (load,) = side.build_connector_meta(output(a=10), lambda rid: [40, 41, 42, 43, 44]).loads
    assert load.peer is None and load.keys
    store(d, 0, TOKENS, 4)
    asked = len(peer.asked)
    assert side.get_num_new_matched_tokens(Req("b", TOKENS + [5]), 0) == (128, False)
    assert len(peer.asked) == asked, "a full host hit asks no peer"
