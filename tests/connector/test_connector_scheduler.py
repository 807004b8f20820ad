"""SchedulerSide against an in-memory daemon: leases, load plans, save plans, releases.

No engine: vLLM's Request, KVCacheBlocks and SchedulerOutput are stood in for
by the few attributes the connector reads. Needs vLLM importable (the
metadata classes subclass vLLM's). Lookups answer at once unless a test
holds them (FakeLink.hold) and lands them later; time is a fake clock and
waiting for an answer is a fake wait (no test depends on timing).
"""
from __future__ import annotations

import itertools
import pickle
from concurrent.futures import Future
from types import SimpleNamespace
from typing import Any, Callable, Dict, List, Optional, Sequence, Tuple

import pytest

from connector_harness import vllm_unavailable

if vllm_unavailable() is not None:
    pytest.skip(vllm_unavailable(), allow_module_level=True)

from kvkeeper.client import MatchResult, UnavailableError  # noqa: E402
from kvkeeper.connector.config import ConnectorConfig  # noqa: E402
from kvkeeper.connector.keys import chain_keys, namespace_seed  # noqa: E402
from kvkeeper.connector.layout import KVLayout  # noqa: E402
from kvkeeper.connector.link import LinkDown  # noqa: E402
from kvkeeper.connector.metadata import KVKeeperWorkerMetadata  # noqa: E402
from kvkeeper.connector.scheduler import IDLE_WAIT_S, SchedulerSide  # noqa: E402
from kvkeeper.v1 import kvkeeper_pb2 as pb  # noqa: E402

BS = 32


def block_ref(key: bytes) -> Any:
    """The BlockRef a Match would return for `key` (made-up place and checksum)."""
    ref = pb.BlockRef(checksum_algo=pb.CHECKSUM_XXH3_64, checksum=int.from_bytes(key[:8], "big"))
    ref.extents.add(offset=int.from_bytes(key[8:10], "big") * 4096, length=4096)
    return ref


def stored_ref(key: bytes) -> Tuple[int, int, List[Tuple[int, int]]]:
    """block_ref(key) as the load names it: (checksum_algo, checksum, extents)."""
    return (pb.CHECKSUM_XXH3_64, int.from_bytes(key[:8], "big"),
            [(int.from_bytes(key[8:10], "big") * 4096, 4096)])


class FakeDaemon:
    """Committed keys, leases and releases of one namespace."""

    def __init__(self) -> None:
        self.keys: set = set()
        self.leases: Dict[int, List[bytes]] = {}
        self.released: List[Tuple[int, bool]] = []
        self.ids = itertools.count(1)
        self.fail: Optional[Exception] = None
        self.arena_id: Optional[bytes] = None   # set: the client maps an arena
        self.reports: List[Tuple[int, Dict[str, int]]] = []   # (lease id or 0, report)
        self.narrowed: List[Tuple[int, int, int]] = []
        self.report_use: List[bool] = []
        self.last_turns: List[int] = []       # leases released with last_turn

    def match(self, keys: Sequence[bytes], lease: bool = False, blocks: bool = False,
              report_use: bool = False):
        self.report_use.append(report_use)
        if self.fail is not None:
            raise self.fail
        n = 0
        for k in keys:
            if k not in self.keys:
                break
            n += 1
        lid = None
        if lease and n:
            lid = next(self.ids)
            self.leases[lid] = list(keys[:n])
        refs = [block_ref(k) for k in keys[:n]] if blocks and self.arena_id else []
        return MatchResult(n, [2] * n, lid, refs)

    def release(self, lease_id: int, discard: bool = False,
                discard_indices: Sequence[int] = (), report: Optional[Dict[str, int]] = None,
                last_turn: bool = False) -> None:
        if last_turn:
            self.last_turns.append(lease_id)
        if report is not None:
            self.reports.append((lease_id, dict(report)))
        if not lease_id:
            assert report is not None and not report["loaded_blocks"]
            return
        keys = self.leases.pop(lease_id)
        self.released.append((lease_id, discard))
        if discard:
            self.keys.difference_update(keys)
        self.keys.difference_update(keys[i] for i in discard_indices)

    def narrow(self, lease_id: int, start: int, count: int) -> None:
        keys = self.leases[lease_id]
        assert count > 0 and 0 <= start and start + count <= len(keys)
        self.leases[lease_id] = keys[start:start + count]
        self.narrowed.append((lease_id, start, count))


class FakeLink:
    name = "fake"

    def __init__(self, daemon: FakeDaemon, down: bool = False) -> None:
        self.daemon = daemon
        self.down = down
        self.calls = 0
        self.submits = 0
        self.hold = False     # submit() leaves its Future pending until land()
        self.held: List[Tuple[Future, Callable[[Any], Any]]] = []
        self.closed = False

    def call(self, fn, what, wait=True):
        self.calls += 1
        if self.down:
            raise LinkDown("down")
        return fn(self.daemon)

    def submit(self, fn, what):
        self.submits += 1
        fut: Future = Future()
        if self.hold:
            self.held.append((fut, fn))
        else:
            self._run(fut, fn, what)
        return fut

    def _run(self, fut: Future, fn, what) -> None:
        try:
            fut.set_result(self.call(fn, what))
        except Exception as e:  # noqa: BLE001 - handed to the waiter, as DaemonLink does
            fut.set_exception(e)

    def land(self, fail: Optional[Exception] = None) -> int:
        """Answer the held calls now (from the daemon's present state), or fail them."""
        held, self.held = self.held, []
        for fut, fn in held:
            if fail is not None:
                fut.set_exception(fail)
            else:
                self._run(fut, fn, "lookup")
        return len(held)

    def close(self) -> None:
        self.closed = True


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


class Waiter:
    """Stands in for concurrent.futures.wait: records each timeout; `during`
    runs while it "waits" (e.g. a lookup lands); unless everything is then
    done, the whole timeout passes on the fake clock."""

    def __init__(self, clock: Clock) -> None:
        self.clock = clock
        self.timeouts: List[float] = []
        self.during: Optional[Callable[[], Any]] = None

    def __call__(self, futures, timeout: float) -> None:
        self.timeouts.append(timeout)
        if self.during is not None:
            self.during()
        if all(f.done() for f in futures):
            self.clock.t += timeout / 10
        else:
            self.clock.t += timeout


class Req:
    def __init__(self, rid: str, tokens: List[int], **kw) -> None:
        self.request_id = rid
        self.all_token_ids = list(tokens)
        self.num_computed_tokens = 0
        self.cache_salt = kw.get("cache_salt")
        self.lora_request = kw.get("lora_request")
        self.mm_features: list = []
        self.prompt_embeds = kw.get("prompt_embeds")
        self.kv_transfer_params = kw.get("kv_transfer_params")

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)


class Blocks:
    def __init__(self, ids: List[int]) -> None:
        self.ids = ids

    def get_block_ids(self):
        return (list(self.ids),)


def layout():
    return KVLayout(layer_names=("l0", "l1"), num_heads=2, block_tokens=BS, content_bytes=256,
                      dtype="float32", physical="LBHNC", spec_kind="FullAttentionSpec")


def ns(rank: int = 0, size: int = 1) -> dict:
    return {"model_id": "m", "model_revision": "", "dtype": "float32", "kv_layout": "x",
            "block_tokens": BS, "block_bytes": 32768, "tp_rank": rank, "tp_size": size}


def make(tp: int = 1, **cfg):
    daemons = [FakeDaemon() for _ in range(tp)]
    links = [FakeLink(d) for d in daemons]
    clock = Clock()
    side = SchedulerSide(ConnectorConfig(url="unix:///nowhere", **cfg), layout(),
                           [ns(r, tp) for r in range(tp)], links, clock=clock,
                           wait=Waiter(clock))
    return side, daemons, links


def store(daemon: FakeDaemon, rank: int, tokens: List[int], blocks: int, tp: int = 1) -> List[bytes]:
    keys = chain_keys(namespace_seed(ns(rank, tp)), tokens, BS)[:blocks]
    daemon.keys.update(keys)
    return keys


def flush(side) -> None:
    for r in side.releasers:
        assert r.flush(5.0)


def output(**sched) -> SimpleNamespace:
    return SimpleNamespace(num_scheduled_tokens=sched, scheduled_spec_decode_tokens={})


def done(load_id: int, good: int, bad: Sequence[int] = (), rank: int = 0):
    return SimpleNamespace(kv_connector_worker_meta=KVKeeperWorkerMetadata(
        loads_done={load_id: {rank: (good, tuple(bad))}}))


TOKENS = list(range(10, 10 + 128))   # 4 full blocks


def test_lookup_caps_at_the_last_token_and_starts_after_the_local_hit() -> None:
    side, (d,), _ = make()
    store(d, 0, TOKENS, 4)
    r = Req("a", TOKENS)
    # all 4 blocks are held: every token but the last one (vLLM computes it)
    assert side.get_num_new_matched_tokens(r, 0) == (127, False)
    assert side.get_num_new_matched_tokens(r, 32) == (95, False)  # blocks 1..3
    assert side.get_num_new_matched_tokens(r, 96) == (31, False)  # the last block only
    assert side.get_num_new_matched_tokens(Req("b", TOKENS + [1]), 0) == (128, False)
    assert side.get_num_new_matched_tokens(Req("c", TOKENS[:32]), 0) == (31, False)
    assert side.get_num_new_matched_tokens(Req("d", TOKENS[:31]), 0) == (0, False)
    assert side.get_num_new_matched_tokens(Req("e", TOKENS[:1]), 0) == (0, False)
    for rid in "abcde":
        side.request_finished(Req(rid, []))
    flush(side)
    assert not d.leases, "every lease is released"


def test_partial_hit_counts_leading_blocks_only() -> None:
    side, (d,), _ = make()
    keys = store(d, 0, TOKENS, 4)
    d.keys.discard(keys[1])
    assert side.get_num_new_matched_tokens(Req("a", TOKENS), 0) == (32, False)


def test_load_plan_then_release_when_the_worker_reports() -> None:
    side, (d,), _ = make()
    keys = store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS + [5] * 10)
    assert side.get_num_new_matched_tokens(r, 0) == (96, False)
    side.update_state_after_alloc(r, Blocks([40, 41, 42, 43, 44]), 96)
    r.num_computed_tokens = 96
    meta = side.build_connector_meta(output(a=42), lambda rid: [40, 41, 42, 43, 44])
    (load,) = meta.loads
    assert load.block_ids == (40, 41, 42) and load.keys == (tuple(keys),)
    # this step computes tokens 96..137: block 3 (96..127) becomes full and is
    # saved, once the load it was computed over is known clean
    (save,) = meta.saves
    assert save.block_ids == (43,) and save.keys[0][0] not in keys
    assert save.after_loads == (load.load_id,) and meta.load_outcomes == {}
    assert len(d.leases) == 1
    side.update_connector_output(done(load.load_id, 3))
    r.num_computed_tokens = 138
    assert side.build_connector_meta(output(a=1), lambda rid: [40, 41, 42, 43, 44]) \
        .load_outcomes == {load.load_id: True}
    flush(side)
    assert d.leases == {} and d.released == [(1, False)]
    assert side.held_leases() == 0
    assert side.request_finished(r) is None  # report off


def test_corrupt_block_is_discarded_and_saved_again_after_recompute() -> None:
    side, (d,), _ = make()
    keys = store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS + [5] * 10)
    side.get_num_new_matched_tokens(r, 0)
    side.update_state_after_alloc(r, Blocks([40, 41, 42, 43, 44]), 96)
    r.num_computed_tokens = 96
    meta = side.build_connector_meta(output(a=42), lambda rid: [40, 41, 42, 43, 44])
    r.num_computed_tokens = 138
    # block 3, computed over the loaded blocks, waits for their outcome
    assert [s.after_loads for s in meta.saves] == [(meta.loads[0].load_id,)]
    # block 1 failed its checksum: vLLM rewinds to token 32 and recomputes
    side.update_connector_output(done(meta.loads[0].load_id, good=1, bad=[1]))
    flush(side)
    assert d.released == [(1, False)]
    assert keys[1] not in d.keys and keys[0] in d.keys and keys[2] in d.keys, \
        "only the corrupt block is dropped"
    r.num_computed_tokens = 32
    meta2 = side.build_connector_meta(output(a=106), lambda rid: [40, 41, 42, 43, 44])
    # the workers drop the save of block 3 (computed over the corrupt block)...
    assert meta2.load_outcomes == {meta.loads[0].load_id: False}
    # ...and blocks 1.. are saved again: block 1 is stored anew, 2 is skipped
    # by the daemon (present), 3 is stored as recomputed
    (save,) = meta2.saves
    assert save.block_ids == (41, 42, 43) and save.keys[0][:2] == tuple(keys[1:])


def test_abort_before_the_load_releases_the_lease() -> None:
    side, (d,), _ = make()
    store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS)
    side.get_num_new_matched_tokens(r, 0)
    side.request_finished(r)
    flush(side)
    assert d.leases == {}
    # and after the load was planned but before the worker reported
    r2 = Req("b", TOKENS)
    side.get_num_new_matched_tokens(r2, 0)
    side.update_state_after_alloc(r2, Blocks([1, 2, 3, 4]), 96)
    side.build_connector_meta(output(b=32), lambda rid: [1, 2, 3, 4])
    side.request_finished(r2)
    flush(side)
    assert d.leases == {} and side.held_leases() == 0


def test_a_last_turn_saves_nothing_and_releases_what_it_read_whole_as_a_last_turn() -> None:
    """kv_transfer_params {"kvkeeper_last_turn": true}: no save is planned, the
    lease is not narrowed to the loaded part (vLLM's own hit is demoted in the
    daemon too), and its release says last_turn."""
    side, (d,), _ = make()
    store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS + [5] * 10, kv_transfer_params={"kvkeeper_last_turn": True})
    assert side.get_num_new_matched_tokens(r, 32) == (64, False)   # vLLM holds block 0
    side.update_state_after_alloc(r, Blocks([40, 41, 42, 43, 44]), 64)
    r.num_computed_tokens = 96
    meta = side.build_connector_meta(output(a=42), lambda rid: [40, 41, 42, 43, 44])
    (load,) = meta.loads
    assert meta.saves == [] and d.narrowed == []
    side.update_connector_output(done(load.load_id, 2))
    flush(side)
    assert d.released == [(1, False)] and d.last_turns == [1]
    assert d.reports == [(1, {"prompt_tokens": 138, "prompt_blocks": 4, "local_blocks": 1,
                              "loaded_blocks": 2})]
    side.request_finished(r)
    # The next request of another conversation is an ordinary one.
    other = Req("b", TOKENS + [5] * 10)
    assert side.get_num_new_matched_tokens(other, 32) == (64, False)
    flush(side)
    assert d.narrowed == [(2, 1, 2)]
    side.request_finished(other)
    flush(side)
    assert d.last_turns == [1]


@pytest.mark.parametrize("params", [{"kvkeeper_last_turn": "yes"}, {"kvkeeper_last_turn": 1},
                                    {"kvkeeper_last_turn": False}, {"other": True}, None, "x"])
def test_anything_but_a_true_last_turn_is_an_ordinary_request(params, caplog) -> None:
    side, (d,), _ = make()
    store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS + [5] * 10, kv_transfer_params=params)
    with caplog.at_level("WARNING", logger="kvkeeper.connector"):
        assert side.get_num_new_matched_tokens(r, 0) == (96, False)
    side.update_state_after_alloc(r, Blocks([40, 41, 42, 43, 44]), 96)
    r.num_computed_tokens = 96
    meta = side.build_connector_meta(output(a=42), lambda rid: [40, 41, 42, 43, 44])
    assert len(meta.saves) == 1
    side.update_connector_output(done(meta.loads[0].load_id, 3))
    flush(side)
    assert d.last_turns == []
    typo = isinstance(params, dict) and not isinstance(params.get("kvkeeper_last_turn", False), bool)
    assert ("kvkeeper_last_turn" in caplog.text) == typo


def test_repeated_lookup_and_unused_hit_release_the_lease() -> None:
    side, (d,), _ = make()
    store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS)
    side.get_num_new_matched_tokens(r, 0)
    side.get_num_new_matched_tokens(r, 0)   # not scheduled last time: asked again
    flush(side)
    assert len(d.leases) == 1
    side.update_state_after_alloc(r, Blocks([1, 2, 3, 4]), 0)  # vLLM chose not to load
    flush(side)
    assert d.leases == {}
    assert side.build_connector_meta(output(a=128), lambda rid: [1, 2, 3, 4]).loads == []


def test_daemon_down_is_a_counted_miss() -> None:
    side, (d,), (link,) = make()
    store(d, 0, TOKENS, 3)
    link.down = True
    assert side.get_num_new_matched_tokens(Req("a", TOKENS), 0) == (0, False)
    d.fail = UnavailableError("gone")
    link.down = False
    assert side.get_num_new_matched_tokens(Req("b", TOKENS), 0) == (0, False)
    stats = side.take_stats()
    assert stats.data["lookup_errors"] == 2 and "hit_tokens" not in stats.data


def test_saves_follow_prefill_chunks_and_decode() -> None:
    side, _, _ = make()
    prompt = list(range(100))
    r = Req("a", prompt)
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    side.update_state_after_alloc(r, Blocks([7, 8, 9, 10]), 0)
    ids = lambda rid: [7, 8, 9, 10]  # noqa: E731
    m1 = side.build_connector_meta(output(a=64), ids)          # chunk 0..63
    assert [s.block_ids for s in m1.saves] == [(7, 8)]
    r.num_computed_tokens = 64
    m2 = side.build_connector_meta(output(a=36), ids)          # chunk 64..99
    assert [s.block_ids for s in m2.saves] == [(9,)]
    r.num_computed_tokens = 100
    for step in range(27):                                      # decode 100..126
        r.all_token_ids.append(1000 + step)
        m = side.build_connector_meta(output(a=1), ids)
        assert m.saves == []
        r.num_computed_tokens += 1
    r.all_token_ids.append(2000)                               # token 127 fills block 3
    m = side.build_connector_meta(output(a=1), ids)
    (save,) = m.saves
    assert save.block_ids == (10,)
    keys = chain_keys(namespace_seed(ns()), r.all_token_ids, BS)
    assert save.keys[0] == (keys[3],)


def test_speculative_tokens_are_not_saved() -> None:
    side, _, _ = make()
    r = Req("a", list(range(60)))
    side.get_num_new_matched_tokens(r, 0)
    so = output(a=64)
    r.all_token_ids += [1, 2, 3, 4]
    so.scheduled_spec_decode_tokens = {"a": [1, 2, 3, 4]}
    m = side.build_connector_meta(so, lambda rid: [0, 1])
    assert [s.block_ids for s in m.saves] == [(0,)]  # 60 final tokens: one full block


def test_tensor_parallel_hits_are_the_minimum_over_ranks() -> None:
    side, (d0, d1), _ = make(tp=2)
    k0 = store(d0, 0, TOKENS, 3, tp=2)
    k1 = store(d1, 1, TOKENS, 2, tp=2)
    assert not set(k0) & set(k1), "each rank has its own keys"
    r = Req("a", TOKENS)
    assert side.get_num_new_matched_tokens(r, 0) == (64, False)
    side.update_state_after_alloc(r, Blocks([5, 6, 7, 8]), 64)
    (load,) = side.build_connector_meta(output(a=64), lambda rid: [5, 6, 7, 8]).loads
    assert load.keys == (tuple(k0[:2]), tuple(k1[:2])) and load.block_ids == (5, 6)
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVKeeperWorkerMetadata(
        loads_done={load.load_id: {0: (2, False), 1: (2, False)}})))
    flush(side)
    assert d0.leases == {} and d1.leases == {}


def test_salt_and_prompt_embeds() -> None:
    side, (d,), (link,) = make()
    store(d, 0, TOKENS, 3)
    assert side.get_num_new_matched_tokens(Req("a", TOKENS, cache_salt="tenant"), 0) == (0, False)
    calls = link.calls
    emb = Req("b", TOKENS, prompt_embeds=object())
    assert side.get_num_new_matched_tokens(emb, 0) == (0, False)
    assert link.calls == calls, "no lookup for prompt embeddings"
    assert side.build_connector_meta(output(b=128), lambda rid: [1, 2, 3, 4]).saves == []


def test_report_and_worker_disable() -> None:
    side, (d,), _ = make(report=True)
    store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS)
    side.get_num_new_matched_tokens(r, 0)
    side.update_state_after_alloc(r, Blocks([1, 2, 3, 4]), 96)
    side.build_connector_meta(output(a=32), lambda rid: [1, 2, 3, 4])
    rep = side.request_finished(r)["kvkeeper"]
    assert rep["hit_tokens"] == 96 and rep["namespace"] == ns() and rep["block_tokens"] == BS
    side.update_connector_output(SimpleNamespace(kv_connector_worker_meta=KVKeeperWorkerMetadata(
        disabled={0: "layout mismatch"})))
    assert side.get_num_new_matched_tokens(Req("b", TOKENS), 0) == (0, False)
    assert side.build_connector_meta(output(b=128), lambda rid: [1, 2, 3, 4]).saves == []


# ---- a full hit: every block loaded, vLLM computes one token

def test_full_hit_loads_the_last_block_and_does_not_save_it_again() -> None:
    side, (d,), _ = make(report=True)
    keys = store(d, 0, TOKENS, 4)
    r = Req("a", TOKENS)
    assert side.get_num_new_matched_tokens(r, 0) == (127, False)
    side.update_state_after_alloc(r, Blocks([10, 11, 12, 13]), 127)
    r.num_computed_tokens = 127
    meta = side.build_connector_meta(output(a=1), lambda rid: [10, 11, 12, 13])
    (load,) = meta.loads
    assert load.block_ids == (10, 11, 12, 13) and load.keys == (tuple(keys),)
    assert meta.saves == [], "the loaded blocks are in the daemon already"
    side.update_connector_output(done(load.load_id, 4))
    r.num_computed_tokens = 128
    r.all_token_ids.append(7)                   # decoding goes on: nothing to save yet
    assert side.build_connector_meta(output(a=1), lambda rid: [10, 11, 12, 13, 14]).saves == []
    rep = side.request_finished(r)["kvkeeper"]
    assert rep["hit_tokens"] == 127
    assert side.take_stats().data["hit_tokens"] == 127
    flush(side)
    assert d.leases == {}


def test_full_hit_beyond_a_local_prefix_hit_loads_only_the_rest() -> None:
    side, (d,), _ = make()
    keys = store(d, 0, TOKENS, 4)
    r = Req("a", TOKENS)
    assert side.get_num_new_matched_tokens(r, 96) == (31, False)
    side.update_state_after_alloc(r, Blocks([10, 11, 12, 13]), 31)
    r.num_computed_tokens = 127
    meta = side.build_connector_meta(output(a=1), lambda rid: [10, 11, 12, 13])
    (load,) = meta.loads
    assert load.block_ids == (13,) and load.keys == ((keys[3],),)
    assert meta.saves == []


def test_failed_load_of_the_last_block_is_recomputed_and_saved() -> None:
    side, (d,), _ = make()
    keys = store(d, 0, TOKENS, 4)
    r = Req("a", TOKENS)
    side.get_num_new_matched_tokens(r, 0)
    side.update_state_after_alloc(r, Blocks([10, 11, 12, 13]), 127)
    r.num_computed_tokens = 127
    ids = lambda rid: [10, 11, 12, 13]  # noqa: E731
    meta = side.build_connector_meta(output(a=1), ids)
    # block 3 could not be loaded (evicted, say): vLLM rewinds to token 96
    side.update_connector_output(done(meta.loads[0].load_id, good=3))
    flush(side)
    assert d.leases == {}
    d.keys.discard(keys[3])
    r.num_computed_tokens = 96
    (save,) = side.build_connector_meta(output(a=32), ids).saves
    assert save.block_ids == (13,) and save.keys == ((keys[3],),)


def test_vllm_may_take_less_than_the_hit() -> None:
    side, (d,), _ = make()
    store(d, 0, TOKENS, 4)
    r = Req("a", TOKENS)
    assert side.get_num_new_matched_tokens(r, 0) == (127, False)
    side.update_state_after_alloc(r, Blocks([10, 11, 12, 13]), 64)   # block-aligned by vLLM
    r.num_computed_tokens = 64
    meta = side.build_connector_meta(output(a=64), lambda rid: [10, 11, 12, 13])
    assert meta.loads[0].block_ids == (10, 11)
    assert [s.block_ids for s in meta.saves] == [(12, 13)]


# ---- lookups that do not block the scheduler

def hold(link: FakeLink) -> FakeLink:
    link.hold = True
    return link


def test_lookup_starts_when_the_request_arrives_and_answers_when_it_lands() -> None:
    side, (d,), (link,) = make()
    hold(link)
    store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS)
    side.on_new_request(r)
    assert len(link.held) == 1 and side.pending_lookups() == 1
    assert side.get_num_new_matched_tokens(r, 0) == (None, False)
    assert side.get_num_new_matched_tokens(r, 0) == (None, False)
    assert link.submits == 1, "a pending lookup is never started twice"
    link.land()
    assert side.get_num_new_matched_tokens(r, 0) == (96, False)
    assert side.pending_lookups() == 0 and side.held_leases() == 1
    stats = side.take_stats().data
    assert stats["lookups"] == 1 and "lookup_errors" not in stats


def test_lookup_that_lands_while_waiting_answers_in_the_same_step() -> None:
    side, (d,), (link,) = make()
    hold(link)
    store(d, 0, TOKENS, 4)
    r = Req("a", TOKENS)
    side._wait.during = link.land
    assert side.get_num_new_matched_tokens(r, 0) == (127, False)   # no on_new_request: asked here
    # nothing else was running: it waited up to IDLE_WAIT_S, not the step's 5 ms
    assert side._wait.timeouts == [IDLE_WAIT_S]


def running(side) -> None:
    """A request vLLM has had its answer for (too short to look up): the
    scheduler is no longer idle."""
    side.on_new_request(Req("running", TOKENS[:2]))
    assert side.get_num_new_matched_tokens(Req("running", TOKENS[:2]), 0) == (0, False)


def test_an_idle_scheduler_waits_longer_for_a_lookup_than_a_busy_one() -> None:
    side, (d,), (link,) = make()
    hold(link)
    store(d, 0, TOKENS, 4)
    r = Req("a", TOKENS)
    side.on_new_request(r)
    # idle, never answered in time: one wait of IDLE_WAIT_S, then pending
    assert side.get_num_new_matched_tokens(r, 0) == (None, False)
    assert side._wait.timeouts == [IDLE_WAIT_S]
    link.land()
    assert side.get_num_new_matched_tokens(r, 0) == (127, False)
    # now a request runs (r was answered): a pending one waits the step's 5 ms only
    r2 = Req("b", TOKENS)
    side.build_connector_meta(output(), lambda rid: None)
    side.on_new_request(r2)
    assert side.get_num_new_matched_tokens(r2, 0) == (None, False)
    assert side._wait.timeouts == [IDLE_WAIT_S, 0.005]
    # once both finished the scheduler is idle again
    side.request_finished(r)
    side.request_finished(r2)
    r3 = Req("c", TOKENS)
    side.build_connector_meta(output(), lambda rid: None)
    side.on_new_request(r3)
    assert side.get_num_new_matched_tokens(r3, 0) == (None, False)
    assert side._wait.timeouts[-1] == IDLE_WAIT_S


def test_wait_budget_is_shared_by_a_step_and_zero_never_waits() -> None:
    side, _, (link,) = make()
    hold(link)
    waiter = side._wait
    running(side)
    r1, r2, r3 = Req("a", TOKENS), Req("b", TOKENS), Req("c", TOKENS)
    for r in (r1, r2, r3):
        side.on_new_request(r)
    assert side.get_num_new_matched_tokens(r1, 0) == (None, False)
    assert side.get_num_new_matched_tokens(r2, 0) == (None, False)
    assert waiter.timeouts == [0.005], "the step's budget was spent on the first request"
    side.build_connector_meta(output(), lambda rid: None)        # the next step
    assert side.get_num_new_matched_tokens(r3, 0) == (None, False)
    assert waiter.timeouts == [0.005, 0.005]
    # a lookup close to its deadline waits no longer than the deadline, then misses
    side.build_connector_meta(output(), lambda rid: None)
    side._clock.t = side._reqs["a"].lookup.deadline - 0.001
    assert side.get_num_new_matched_tokens(r1, 0) == (0, False)
    assert waiter.timeouts[-1] == pytest.approx(0.001)

    never, _, (link2,) = make(lookup_wait_s=0.0)
    hold(link2)
    r = Req("a", TOKENS)
    assert never.get_num_new_matched_tokens(r, 0) == (None, False)
    assert never._wait.timeouts == []
    link2.land()
    assert never.get_num_new_matched_tokens(r, 0) == (0, False)    # the daemon holds nothing


def test_a_lookup_vllms_own_cache_makes_moot_is_answered_without_waiting() -> None:
    """vLLM's own prefix cache holds every block a hit could cover: the
    answer is 0 at once, whatever the daemon will say, and the lease the
    lookup takes is released as it lands, with the lookup's report (vLLM's
    own hit counts as ever) and the request's last turn."""
    side, (d,), (link,) = make()
    hold(link)
    store(d, 0, TOKENS, 4)
    r = Req("a", TOKENS, kv_transfer_params={"kvkeeper_last_turn": True})
    side.on_new_request(r)
    assert side.get_num_new_matched_tokens(r, 127) == (0, False)
    assert side._wait.timeouts == [] and side.pending_lookups() == 0
    assert side.take_stats().data["lookups"] == 1
    assert d.released == [], "the Match has not landed"
    link.land()
    flush(side)
    assert d.leases == {} and d.released == [(1, False)] and d.last_turns == [1]
    assert d.reports == [(1, {"prompt_tokens": 128, "prompt_blocks": 4, "local_blocks": 3,
                              "loaded_blocks": 0})]
    # one block short of that, a hit could add it: the lookup is waited for
    # (the step's 5 ms: r, answered, runs in this step)
    r2 = Req("b", TOKENS)
    side.on_new_request(r2)
    assert side.get_num_new_matched_tokens(r2, 96) == (None, False)
    assert side._wait.timeouts == [0.005]
    link.land()
    assert side.get_num_new_matched_tokens(r2, 96) == (31, False)


def test_failed_or_late_lookup_is_a_miss_and_its_lease_is_released() -> None:
    side, (d,), (link,) = make()
    hold(link)
    store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS)
    side.on_new_request(r)
    link.land(fail=UnavailableError("gone"))
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    # not answered within kvkeeper_lookup_timeout_s: a miss, never "pending" forever
    r2 = Req("b", TOKENS)
    side.on_new_request(r2)
    assert side.get_num_new_matched_tokens(r2, 0) == (None, False)
    side._clock.t += side.cfg.lookup_timeout_s
    assert side.get_num_new_matched_tokens(r2, 0) == (0, False)
    assert side.pending_lookups() == 0
    assert side.take_stats().data["lookup_errors"] == 2
    link.land()                                   # the late answer took a lease...
    flush(side)
    assert d.leases == {} and len(d.released) == 1, "...released as it landed"


def test_abort_while_the_lookup_is_pending_releases_the_lease_when_it_lands() -> None:
    side, (d0, d1), links = make(tp=2)
    store(d0, 0, TOKENS, 3, tp=2)
    store(d1, 1, TOKENS, 3, tp=2)
    for link in links:
        hold(link)
    r = Req("a", TOKENS)
    side.on_new_request(r)
    assert side.get_num_new_matched_tokens(r, 0) == (None, False)
    assert side.request_finished(r) is None
    assert side.pending_lookups() == 0
    links[0].land()
    links[1].land()
    flush(side)
    assert d0.leases == {} and d1.leases == {}
    assert len(d0.released) == len(d1.released) == 1


def test_tensor_parallel_answer_waits_for_every_rank() -> None:
    side, (d0, d1), (l0, l1) = make(tp=2)
    store(d0, 0, TOKENS, 3, tp=2)
    store(d1, 1, TOKENS, 2, tp=2)
    hold(l0), hold(l1)
    r = Req("a", TOKENS)
    side.on_new_request(r)
    l0.land()
    assert side.get_num_new_matched_tokens(r, 0) == (None, False)
    l1.land(fail=UnavailableError("rank 1 down"))
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    flush(side)
    assert d0.leases == {}, "rank 0's lease is released when rank 1 failed"


def test_preempted_request_is_looked_up_again_and_may_be_aborted_meanwhile() -> None:
    side, (d,), (link,) = make()
    keys = store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS + [5] * 10)
    side.on_new_request(r)
    assert side.get_num_new_matched_tokens(r, 0) == (96, False)
    side.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5]), 96)
    r.num_computed_tokens = 96
    meta = side.build_connector_meta(output(a=42), lambda rid: [1, 2, 3, 4, 5])
    side.update_connector_output(done(meta.loads[0].load_id, 3))
    r.num_computed_tokens = 138
    # preempted: vLLM frees its blocks and, to resume it, asks again from scratch
    r.num_computed_tokens = 0
    r.all_token_ids += [6] * 30                  # 168 tokens: 5 full blocks now
    d.keys.update(chain_keys(namespace_seed(ns()), r.all_token_ids, BS)[3:4])   # it saved block 3
    hold(link)
    assert side.get_num_new_matched_tokens(r, 0) == (None, False)
    assert side.get_num_new_matched_tokens(r, 0) == (None, False)
    assert link.submits == 2 and len(link.held) == 1
    link.land()
    assert side.get_num_new_matched_tokens(r, 0) == (128, False)
    assert d.leases and list(d.leases.values())[-1][:3] == keys
    # not scheduled (no room), asked again, and aborted before the answer lands
    assert side.get_num_new_matched_tokens(r, 0) == (None, False)
    side.request_finished(r)
    link.land()
    flush(side)
    assert d.leases == {} and side.held_leases() == 0


def test_shutdown_does_not_wait_for_pending_lookups() -> None:
    side, (d,), (link,) = make()
    hold(link)
    store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS)
    side.on_new_request(r)
    side.get_num_new_matched_tokens(r, 0)
    side.shutdown()
    assert link.closed and side.pending_lookups() == 0
    link.land()    # lands after the shutdown: its lease goes with the closed session


def test_no_lookup_for_what_cannot_load() -> None:
    side, (d,), (link,) = make()
    store(d, 0, TOKENS, 3)
    side.on_new_request(Req("a", TOKENS, prompt_embeds=object()))
    side.on_new_request(Req("b", TOKENS[:20]))      # no full block
    r = Req("c", TOKENS)
    r.skip_reading_prefix_cache = True
    side.on_new_request(r)
    assert link.submits == 0
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    producer = SchedulerSide(ConnectorConfig(url="unix:///nowhere", load=False), layout(),
                             [ns()], [link])
    producer.on_new_request(Req("d", TOKENS))
    assert link.submits == 0


def test_lookup_wait_setting() -> None:
    def parse(extra: dict) -> ConnectorConfig:
        return ConnectorConfig.from_extra({"kvkeeper_url": "h:1", **extra}, None, env={})

    assert parse({}).lookup_wait_s == 0.005
    assert parse({"kvkeeper_lookup_wait_s": "0"}).lookup_wait_s == 0.0
    assert parse({"kvkeeper_lookup_wait_s": 0.02}).lookup_wait_s == 0.02
    with pytest.raises(ValueError, match="kvkeeper_lookup_wait_s"):
        parse({"kvkeeper_lookup_wait_s": -1})


def test_the_load_carries_the_schedulers_refs_for_the_blocks_it_loads() -> None:
    """Where the lookup's Match returned arena refs (from block 0), the load
    names those of the blocks it loads, per rank, with the arena they are in;
    without refs (a streaming client) it names none and the worker matches."""
    side, (d,), _ = make()
    d.arena_id = b"arena-1"
    keys = store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS + [5] * 10)
    assert side.get_num_new_matched_tokens(r, 32) == (64, False)   # blocks 1, 2
    side.update_state_after_alloc(r, Blocks([40, 41, 42, 43, 44]), 64)
    (load,) = side.build_connector_meta(output(a=74), lambda rid: [40, 41, 42, 43, 44]).loads
    assert load.block_ids == (41, 42)
    # Plain data (pickled to the workers every step), not BlockRef messages.
    assert load.refs == ((stored_ref(keys[1]), stored_ref(keys[2])),)
    assert pickle.loads(pickle.dumps(load)).refs == load.refs
    assert b"kvkeeper_pb2" not in pickle.dumps(load)
    assert load.arena_ids == (b"arena-1",)
    d.arena_id = None
    r2 = Req("b", TOKENS + [6] * 10)
    assert side.get_num_new_matched_tokens(r2, 0) == (96, False)
    side.update_state_after_alloc(r2, Blocks([50, 51, 52, 53, 54]), 96)
    (load2,) = side.build_connector_meta(output(b=42), lambda rid: [50, 51, 52, 53, 54]).loads
    assert load2.refs == () and load2.block_ids == (50, 51, 52)


def test_each_save_names_the_key_before_its_first_block_on_every_rank() -> None:
    """The daemon links a save that continues a chain (a later prefill chunk,
    a block filled by decoding) under the block it extends: ReserveSave's
    parent_key, b"" for the chain's first block."""
    side, _, _ = make(tp=2)
    r = Req("a", list(range(100)))
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    side.update_state_after_alloc(r, Blocks([7, 8, 9, 10]), 0)
    ids = lambda rid: [7, 8, 9, 10]  # noqa: E731
    m1 = side.build_connector_meta(output(a=64), ids)          # blocks 0, 1
    r.num_computed_tokens = 64
    m2 = side.build_connector_meta(output(a=36), ids)          # block 2
    r.num_computed_tokens = 100
    r.all_token_ids += list(range(1000, 1028))                 # decode fills block 3
    m3 = side.build_connector_meta(output(a=28), ids)
    chains = [chain_keys(namespace_seed(ns(rank, 2)), r.all_token_ids, BS) for rank in range(2)]
    (s1,), (s2,), (s3,) = m1.saves, m2.saves, m3.saves
    assert s1.parents == (b"", b"")
    assert s2.parents == tuple(c[1] for c in chains) and s2.keys == tuple((c[2],) for c in chains)
    assert s3.parents == tuple(c[2] for c in chains) and s3.keys == tuple((c[3],) for c in chains)


def test_a_request_ending_in_its_loading_step_keeps_its_blocks_until_the_outcome_went_out() -> None:
    """Its save waits for the load's outcome, which goes out with a later
    step's metadata; vLLM steps on only while a finished request awaits its
    free, so the free is held until then (load_gates.py)."""
    side, (d,), _ = make()
    store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS + [5] * 10)
    side.get_num_new_matched_tokens(r, 0)
    side.update_state_after_alloc(r, Blocks([40, 41, 42, 43, 44]), 96)
    r.num_computed_tokens = 96
    meta = side.build_connector_meta(output(a=42), lambda rid: [40, 41, 42, 43, 44])
    load_id = meta.loads[0].load_id
    side.request_finished(r)            # one output token: it ends in this step
    assert side.gates.held("a")
    # Asynchronous scheduling: the next step is planned before the report.
    assert side.build_connector_meta(output(), lambda rid: None).load_outcomes == {}
    assert side.gates.held("a")
    side.update_connector_output(done(load_id, 3))
    assert side.gates.held("a"), "reported, but not yet sent to the workers"
    assert side.build_connector_meta(output(), lambda rid: None).load_outcomes == {load_id: True}
    assert not side.gates.held("a")
    flush(side)


def test_a_held_free_is_let_go_after_a_while_without_a_report() -> None:
    from kvkeeper.connector.load_gates import HOLD_S, LoadGates
    from kvkeeper.connector.metadata import LoadSpec

    now = [0.0]
    gates = LoadGates(clock=lambda: now[0])
    gates.planned(LoadSpec("a", ((b"k" * 32,),), (1,), load_id=7))
    gates.hold("a", {7})
    gates.hold("b", {8})                # never planned: nothing to wait for
    assert gates.held("a") and not gates.held("b")
    now[0] = HOLD_S + 1                 # no worker ever reported load 7
    assert not gates.held("a")


def test_a_corrupt_blocks_discard_holds_the_scheduler_loop_only_briefly() -> None:
    """update_connector_output runs on vLLM's scheduler loop: with the daemon
    stuck, it must not wait for the discard up to the lookup timeout (a
    reviewer measured 1 s per corrupt load); the discard lands when it can."""
    import threading

    side, (d,), _ = make(lookup_timeout_s=30.0)
    keys = store(d, 0, TOKENS, 3)
    r = Req("a", TOKENS + [5] * 10)
    side.get_num_new_matched_tokens(r, 0)
    side.update_state_after_alloc(r, Blocks([40, 41, 42, 43, 44]), 96)
    meta = side.build_connector_meta(output(a=42), lambda rid: [40, 41, 42, 43, 44])
    stuck = threading.Event()
    release = d.release
    d.release = lambda *a, **kw: (stuck.wait(), release(*a, **kw))[1]   # type: ignore[method-assign]
    unstick = threading.Timer(2.0, stuck.set)   # far past the wait allowed, far below the timeout
    unstick.start()
    try:
        side.update_connector_output(done(meta.loads[0].load_id, good=1, bad=[1]))
        assert not stuck.is_set(), "the scheduler loop waited for the stuck daemon"
    finally:
        unstick.cancel()
        stuck.set()
    flush(side)
    assert keys[1] not in d.keys and d.released == [(1, False)], "the discard still landed"
