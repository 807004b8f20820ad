"""The connector's residency reports (connector/residency.py) into a real
daemon, from vLLM's own KV cache event classes fed through a stand-in block
pool: keys as the connector names the blocks, at most one report per step,
nothing reported for blocks whose KV their tokens do not name, vLLM handed
no events when it had them off. And the hit sources' split (hit_sources.py)."""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any, List

import pytest

from connector_harness import vllm_unavailable

if vllm_unavailable() is not None:
    pytest.skip(vllm_unavailable(), allow_module_level=True)

from vllm.distributed.kv_events import AllBlocksCleared, BlockRemoved, BlockStored  # noqa: E402

from kvkeeper.client.keys import RequestSeeds, chain_keys, namespace_seed  # noqa: E402
from kvkeeper.connector.hit_sources import split_hit  # noqa: E402
from kvkeeper.connector.link import DaemonLink  # noqa: E402
from kvkeeper.connector.residency import ResidencyReporter  # noqa: E402

BS = 32
NS = {"model_id": "residency-connector", "block_tokens": BS, "block_bytes": 4096}
WAIT_S = 10.0


class Pool:
    """The few attributes of vLLM's BlockPool the reporter reads."""

    def __init__(self, events_on: bool = False) -> None:
        self.hash_block_size = BS
        self.num_gpu_blocks = 16
        self.enable_kv_cache_events = events_on
        self.queue: List[Any] = []
        self.takes = 0

    def take_events(self) -> List[Any]:
        self.takes += 1
        events, self.queue = self.queue, []
        return events


def stored(hashes: List[int], parent: Any, tokens: List[int], extra: Any = None) -> BlockStored:
    return BlockStored(block_hashes=hashes, parent_block_hash=parent, token_ids=tokens,
                       block_size=BS, lora_id=None, medium="GPU", lora_name=None,
                       extra_keys=extra, group_idx=0)


@pytest.fixture
def link(daemon: Any) -> Any:
    lk = DaemonLink(f"unix://{daemon.socket_path}", NS, instance_id="engine a", timeout=5.0)
    yield lk
    lk.close()


def book(daemon: Any) -> List[bytes]:
    books = list(daemon.ledger.residency.books.values())
    return list(books[0].blocks) if books else []


async def until(cond: Any, what: str) -> None:
    import asyncio
    deadline = time.monotonic() + WAIT_S
    while not cond():
        assert time.monotonic() < deadline, what
        await asyncio.sleep(0.01)


async def test_stored_removed_cleared_reach_the_daemon_as_the_connectors_keys(
        daemon: Any, link: Any) -> None:
    r = ResidencyReporter([link], BS)
    pool = Pool()
    r.bind(pool)
    tokens = list(range(5 * BS))
    seed = namespace_seed(NS)
    keys = chain_keys(seed, tokens, BS)
    r.seen(SimpleNamespace(request_id="r1", block_hashes=[b"vllm-hash-0"]), RequestSeeds([NS]))
    # vLLM's hashes are its own; the events name them as ints, as vLLM 0.32 does.
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    h = [maybe_convert_block_hash(b"vllm-hash-0")] + [1000 + i for i in range(1, 5)]
    pool.queue = [stored(h[:3], None, tokens[:3 * BS])]
    assert pool.take_events() == []          # vLLM had events off: it gets none, as before
    assert pool.enable_kv_cache_events
    await until(lambda: book(daemon) == keys[:3], "the first three blocks reported")
    pool.queue = [stored(h[3:], h[2], tokens[3 * BS:]), BlockRemoved(block_hashes=[h[1]],
                                                                      medium="GPU")]
    pool.take_events()
    await until(lambda: book(daemon) == [keys[0], keys[2], keys[3], keys[4]], "stored, removed")
    cap = daemon.ledger.residency.books[link.session_id()].capacity_blocks
    assert cap == pool.num_gpu_blocks
    pool.queue = [AllBlocksCleared()]
    pool.take_events()
    await until(lambda: book(daemon) == [], "cleared")
    assert r.failures == 0 and r.reports <= pool.takes


async def test_blocks_with_media_and_unseen_requests_are_not_reported(daemon: Any,
                                                                       link: Any) -> None:
    r = ResidencyReporter([link], BS)
    pool = Pool(events_on=True)
    r.bind(pool)
    tokens = list(range(3 * BS))
    seed = namespace_seed(NS)
    keys = chain_keys(seed, tokens, BS)
    from vllm.v1.core.kv_cache_utils import maybe_convert_block_hash
    h0 = maybe_convert_block_hash(b"root")
    r.seen(SimpleNamespace(request_id="r1", block_hashes=[b"root"]), RequestSeeds([NS]))
    # A request with media: its seed differs, its blocks are never reported.
    media = SimpleNamespace(identifier="img", mm_position=SimpleNamespace(offset=3, length=4))
    r.seen(SimpleNamespace(request_id="r2", block_hashes=[b"media"], mm_features=[media]), RequestSeeds([NS]))
    h_media = maybe_convert_block_hash(b"media")
    ev = [stored([h0, 2, 3], None, tokens, extra=[None, (("img", 0),), None]),
          stored([7, 8], None, list(range(2 * BS))),   # a request the connector never saw
          stored([h_media], None, list(range(BS)))]
    pool.queue = list(ev)
    assert pool.take_events() == ev         # vLLM had events on: it still gets them all
    await until(lambda: r.reports >= 1, "a report")
    # Block 1 holds media: it and what follows are not named by their tokens.
    assert book(daemon) == keys[:1]


def test_hit_sources_split_the_hit_by_tier() -> None:
    # Blocks 0-1 host, 2 disk; vLLM held block 0; the hit is blocks 1-2 less a token.
    assert split_hit([2, 2, 3], 1, 32, 63, 32) == {"host": 32, "disk": 31}
    assert split_hit([2, 3], 0, 0, 64, 32) == {"host": 32, "disk": 32}
    assert split_hit([2], 0, 0, 64, 32) == {}        # tiers do not cover the hit
    assert split_hit([2, 9], 0, 0, 64, 32) == {}     # a tier with no source
    assert split_hit([1, 2], 0, 0, 40, 32) == {"p2p": 32, "host": 8}


def test_reports_off_leaves_the_pool_alone(link: Any) -> None:
    r = ResidencyReporter([link], BS, off=True)
    pool = Pool()
    take = pool.take_events
    r.bind(pool)
    assert not r.enabled and not pool.enable_kv_cache_events and pool.take_events == take


def test_the_schedulers_hit_is_split_by_the_tiers_the_lookup_named() -> None:
    from test_connector_scheduler import TOKENS, Blocks, Req, make, store

    from kvkeeper.client import MatchResult
    from kvkeeper.connector.connector import KVKeeperConnector
    from vllm.v1.metrics.cache_hit_source import CacheHitSource

    side, (d,), _ = make()
    store(d, 0, TOKENS, 4)
    plain = d.match

    def match(*a, **kw):   # blocks 0-1 from the host tier, 2-3 promoted from disk
        r = plain(*a, **kw)
        return MatchResult(r.matched, [2, 2, 3, 3][:r.matched], r.lease_id, r.blocks)

    d.match = match
    r = Req("a", TOKENS)
    assert side.get_num_new_matched_tokens(r, 32) == (95, False)
    side.update_state_after_alloc(r, Blocks([40, 41, 42, 43]), 95)
    assert side.hit_sources(r) == {"host": 32, "disk": 63}
    conn = SimpleNamespace(_sched=side, _cache_hit_source=CacheHitSource.HOST)
    hit = KVKeeperConnector.get_external_cache_hit_sources
    assert hit(conn, r, 95) == {CacheHitSource.HOST: 32, CacheHitSource.DISK: 63}
    # A count vLLM reports otherwise than planned: all under the default source.
    assert hit(conn, r, 90) == {CacheHitSource.HOST: 90}
    assert hit(conn, Req("unknown", TOKENS), 10) == {CacheHitSource.HOST: 10}
    assert hit(conn, r, 0) == {}
