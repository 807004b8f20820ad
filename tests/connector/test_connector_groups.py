"""Several KV cache groups (connector/groups.py), without an engine: the
scheduler side over (rank, group) slots, and a rank's grouped worker.

The scheduler's fakes are test_connector_scheduler's (an in-memory daemon per
namespace); the grouped worker's sub-workers are stand-ins recording what
they are handed.
"""
from __future__ import annotations

from types import SimpleNamespace
from typing import Any, Dict, List

import pytest

from connector_harness import vllm_unavailable

if vllm_unavailable() is not None:
    pytest.skip(vllm_unavailable(), allow_module_level=True)

from test_connector_scheduler import (BS, Clock, FakeDaemon, FakeLink, Req, Waiter,  # noqa: E402
                                      flush, output)

from kvkeeper.connector.config import ConnectorConfig  # noqa: E402
from kvkeeper.connector.groups import (NULL_BLOCK, GroupedWorker, group_load,  # noqa: E402
                                       group_save, slot_of)
from kvkeeper.connector.keys import chain_keys, namespace_seed  # noqa: E402
from kvkeeper.connector.layout import KVLayout  # noqa: E402
from kvkeeper.connector.metadata import (KVKeeperConnectorMetadata, KVKeeperWorkerMetadata,  # noqa: E402
                                         LoadSpec, SaveSpec)
from kvkeeper.connector.scheduler import SchedulerSide  # noqa: E402

TOKENS = list(range(10, 10 + 6 * BS))   # 6 full blocks


def lay(group: int, window: int = 0) -> KVLayout:
    return KVLayout(layer_names=(f"g{group}.l0", f"g{group}.l1"), num_heads=2, block_tokens=BS,
                    content_bytes=256, dtype="float32", physical="LBHNC",
                    spec_kind="SlidingWindowSpec" if window else "FullAttentionSpec",
                    window=window, group=group, groups=2)


def ns(group: int) -> dict:
    return {"model_id": "m", "model_revision": "", "dtype": "float32",
            "kv_layout": lay(group, 64 if group else 0).layout_string(), "block_tokens": BS,
            "block_bytes": 32768, "tp_rank": 0, "tp_size": 1}


def make():
    daemons = [FakeDaemon() for _ in range(2)]
    clock = Clock()
    side = SchedulerSide(ConnectorConfig(url="unix:///nowhere", report=True), lay(0), [ns(0), ns(1)],
                         [FakeLink(d) for d in daemons], clock=clock, wait=Waiter(clock),
                         groups=2, async_loads=True)
    return side, daemons


def store(daemon: FakeDaemon, group: int, blocks: int) -> List[bytes]:
    keys = chain_keys(namespace_seed(ns(group)), TOKENS, BS)[:blocks]
    daemon.keys.update(keys)
    return keys


class Blocks:
    def __init__(self, *groups: List[int]) -> None:
        self.groups = groups

    def get_block_ids(self):
        return tuple(list(g) for g in self.groups)


def test_a_hit_counts_only_where_every_group_holds_its_blocks() -> None:
    side, (full, sliding) = make()
    store(full, 0, 6)
    store(sliding, 1, 3)
    # several groups: the load is asynchronous (vLLM takes no per-block failures)
    assert side.get_num_new_matched_tokens(Req("a", TOKENS), 0) == (3 * BS, True)
    side.request_finished(Req("a", []))
    store(sliding, 1, 6)
    assert side.get_num_new_matched_tokens(Req("b", TOKENS), 0) == (6 * BS - 1, True)
    side.request_finished(Req("b", []))
    flush(side)
    assert not full.leases and not sliding.leases


def test_the_load_names_every_groups_blocks_and_keys() -> None:
    side, (full, sliding) = make()
    kf, ks = store(full, 0, 6), store(sliding, 1, 6)
    r = Req("a", TOKENS + [1])
    assert side.get_num_new_matched_tokens(r, 0) == (6 * BS, True)
    # vLLM allocates the sliding group only inside the window: null blocks before it
    side.update_state_after_alloc(r, Blocks([1, 2, 3, 4, 5, 6, 7], [0, 0, 0, 0, 8, 9, 10]),
                                  6 * BS)
    (load,) = side.build_connector_meta(output(), lambda rid: None).loads
    assert load.keys == (tuple(kf), tuple(ks))
    assert load.group_block_ids == ((1, 2, 3, 4, 5, 6), (0, 0, 0, 0, 8, 9))
    part, skip = group_load(load, 1)
    assert (part.block_ids, skip) == ((8, 9), 4)
    assert part.keys == (tuple(kf[4:]), tuple(ks[4:])) and part.group_block_ids == ()
    # A same-host peer's entries pair with the blocks by position: cut alike.
    from dataclasses import replace
    peered, _ = group_load(replace(load, peer=("seg", tuple((40 + i, 1) for i in range(6)))), 1)
    assert peered.peer == ("seg", ((44, 1), (45, 1)))
    assert group_load(load, 0) == (group_load(load, 0)[0], 0)
    assert group_load(load, 0)[0].block_ids == (1, 2, 3, 4, 5, 6)
    side.request_finished(r)
    flush(side)


def test_saves_name_every_groups_blocks_and_skip_the_null_block() -> None:
    side, _ = make()
    r = Req("a", TOKENS)
    assert side.get_num_new_matched_tokens(r, 0) == (0, False)
    meta = side.build_connector_meta(output(a=len(TOKENS)),
                                     lambda rid: ([1, 2, 3, 4, 5, 6], [0, 7, 8, 9, 10, 11]))
    (save,) = meta.saves
    assert save.group_block_ids == ((1, 2, 3, 4, 5, 6), (0, 7, 8, 9, 10, 11))
    part = group_save(save, 1)
    assert part.block_ids == (7, 8, 9, 10, 11)
    assert part.keys == tuple(tuple(k[1:]) for k in save.keys)
    assert group_save(save, 0).block_ids == (1, 2, 3, 4, 5, 6)
    report = side.request_finished(r)["kvkeeper"]
    assert report["namespaces"] == [ns(0), ns(1)] and len(report["seeds"]) == 2
    flush(side)


def test_a_null_block_inside_a_load_ends_that_groups_part() -> None:
    spec = LoadSpec(req_id="a", keys=((b"1", b"2", b"3", b"4"),), block_ids=(5, 6, 7, 8),
                    group_block_ids=((5, 6, 7, 8), (0, 6, 0, 8)))
    part, skip = group_load(spec, 1)
    assert (part.block_ids, part.keys, skip) == ((6,), ((b"2",),), 1)
    assert NULL_BLOCK == 0 and slot_of(1, 1, 3) == 4


# ---- the grouped worker


class SubWorker:
    """Stands in for a WorkerSide: records its calls, reports what it is told."""

    def __init__(self, rank: int, layout: KVLayout) -> None:
        self.rank = rank
        self.layout = layout
        self.loads: List[LoadSpec] = []
        self.saves: List[SaveSpec] = []
        self.results: Dict[int, Dict[int, Any]] = {}
        self.copied_all = 0
        self.registered: Dict[str, Any] = {}

    def register_kv_caches(self, kv: Dict[str, Any], num_blocks: int) -> None:
        self.registered = dict(kv)

    def start_load_kv(self, meta: KVKeeperConnectorMetadata) -> None:
        self.loads += meta.loads

    def wait_for_save(self, meta: KVKeeperConnectorMetadata) -> None:
        self.saves += meta.saves

    def take_results(self) -> Dict[int, Dict[int, Any]]:
        out, self.results = self.results, {}
        return out

    def build_worker_meta(self):
        return None

    def copy_out_all(self) -> None:
        self.copied_all += 1


def grouped():
    subs = [SubWorker(slot_of(0, 0, 2), lay(0)), SubWorker(slot_of(0, 1, 2), lay(1, 64))]
    return GroupedWorker(subs), subs


LOAD = LoadSpec(req_id="r", keys=((b"a", b"b", b"c"), (b"x", b"y", b"z")), block_ids=(4, 5, 6),
                load_id=7, group_block_ids=((4, 5, 6), (0, 0, 9)))


def test_each_group_loads_its_part_and_the_request_is_answered_once_all_did() -> None:
    w, (full, sliding) = grouped()
    w.start_load_kv(KVKeeperConnectorMetadata(loads=[LOAD]))
    assert full.loads[0].block_ids == (4, 5, 6) and sliding.loads[0].block_ids == (9,)
    full.results = {7: {0: (3, ())}}
    assert w.transfer_results() == (set(), set())    # the sliding group has not answered
    sliding.results = {7: {1: (1, ())}}
    assert w.transfer_results() == ({"r"}, set())
    assert w.take_load_errors() == set()              # never block ids
    meta = w.build_worker_meta()
    # the sliding group's positions outside the window count as loaded
    assert meta.loads_done == {7: {0: (3, ()), 1: (3, ())}}
    assert w.transfer_results() == (set(), set())    # answered once


def test_a_group_that_fails_fails_its_request_with_positions_of_the_whole_load() -> None:
    w, (full, sliding) = grouped()
    w.start_load_kv(KVKeeperConnectorMetadata(loads=[LOAD]))
    full.results = {7: {0: (3, ())}}
    sliding.results = {7: {1: (0, (0,))}}            # its one block was corrupt
    assert w.transfer_results() == ({"r"}, {"r"})
    assert w.build_worker_meta().loads_done[7][1] == (2, (2,))


def test_saves_split_by_group_and_sliding_groups_copy_out_before_the_forward() -> None:
    w, (full, sliding) = grouped()
    save = SaveSpec(req_id="r", keys=((b"a", b"b"), (b"x", b"y")), block_ids=(4, 5),
                    group_block_ids=((4, 5), (0, 9)))
    w.wait_for_save(KVKeeperConnectorMetadata(saves=[save]))
    assert full.saves[0].block_ids == (4, 5) and sliding.saves[0].block_ids == (9,)
    w.before_forward()
    assert (full.copied_all, sliding.copied_all) == (0, 1)


def test_each_group_gets_its_own_layers_kv_tensors() -> None:
    w, (full, sliding) = grouped()
    kv = {n: SimpleNamespace(name=n) for n in ("g0.l0", "g0.l1", "g1.l0", "g1.l1")}
    w.register_kv_caches(kv, 8)
    assert set(full.registered) == {"g0.l0", "g0.l1"}
    assert set(sliding.registered) == {"g1.l0", "g1.l1"}




# ---- real worker sides over real KV tensors and a real daemon


def test_grouped_worker_saves_and_loads_each_groups_blocks_through_a_daemon() -> None:
    import shutil
    import time

    import torch

    from connector_harness import DaemonProcess, short_tmpdir
    from kvkeeper.connector.blocks import BlockCodec
    from kvkeeper.connector.link import DaemonLink
    from kvkeeper.connector.worker import WorkerSide

    tmp = short_tmpdir()
    d = DaemonProcess(f"{tmp}/kvk.sock", capacity="16MiB", page="16KiB").start()
    g = torch.Generator().manual_seed(5)
    kv = {n: torch.randn(12, 2, BS, 64, generator=g)
          for n in ("g0.l0", "g0.l1", "g1.l0", "g1.l1")}
    cfg = ConnectorConfig(url=d.url)
    subs = [WorkerSide(cfg, lay(i, 64 if i else 0), i,
                       DaemonLink(d.url, ns(i), instance_id=f"g{i}", timeout=5.0))
            for i in range(2)]
    w = GroupedWorker(subs)
    try:
        w.register_kv_caches(kv, 12)
        for s in subs:   # connected (register_kv_caches connects in the background)
            deadline = time.monotonic() + 20
            while True:
                try:
                    s.link.call(lambda c: None, "connect")
                    break
                except Exception:  # noqa: BLE001
                    assert time.monotonic() < deadline
                    time.sleep(0.1)
        keys = tuple(tuple(chain_keys(namespace_seed(ns(i)), TOKENS, BS)[:4]) for i in range(2))
        save = SaveSpec(req_id="a", keys=keys, block_ids=(1, 2, 3, 4),
                        group_block_ids=((1, 2, 3, 4), (5, 6, 7, 8)))
        w.wait_for_save(KVKeeperConnectorMetadata(saves=[save]))
        w.copy_out_for({"a"})
        assert w.flush(10.0)
        codecs = [BlockCodec(lay(i, 64 if i else 0), {n: t for n, t in kv.items()
                                                      if n.startswith(f"g{i}.")}, 12)
                  for i in range(2)]

        def rows(i: int, ids):
            r = codecs[i].new_rows(len(ids))
            codecs[i].gather(list(ids), r)
            return r

        before_null = rows(1, [0]).clone()
        saved0, saved1 = rows(0, [1, 2, 3, 4]), rows(1, [5, 6, 7, 8])
        # the sliding group holds only the last two blocks of the hit
        load = LoadSpec(req_id="b", keys=keys, block_ids=(9, 10, 11, 5), load_id=1,
                        group_block_ids=((9, 10, 11, 5), (0, 0, 11, 10)))
        w.start_load_kv(KVKeeperConnectorMetadata(loads=[load]))
        assert w.transfer_results() == ({"b"}, set())
        assert w.take_load_errors() == set()
        assert w.build_worker_meta().loads_done == {1: {0: (4, ()), 1: (4, ())}}
        assert torch.equal(rows(0, [9, 10, 11, 5]), saved0)
        assert torch.equal(rows(1, [11, 10]), saved1[2:])
        assert torch.equal(rows(1, [0]), before_null)   # the null block is never written
    finally:
        w.shutdown()
        d.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)
