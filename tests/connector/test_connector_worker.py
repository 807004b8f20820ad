"""WorkerSide with real KV tensors and a real daemon, no engine: save, load,
missing and corrupt blocks, daemon down, layout mismatch."""
from __future__ import annotations

import shutil
import time
from typing import Dict, Iterator, Tuple

import pytest

from connector_harness import DaemonProcess, corrupt_stored_block, short_tmpdir, vllm_unavailable

if vllm_unavailable() is not None:
    pytest.skip(vllm_unavailable(), allow_module_level=True)

import torch  # noqa: E402

from kvkeeper.client.copies import stored  # noqa: E402
from kvkeeper.connector.config import ConnectorConfig  # noqa: E402
from kvkeeper.connector.keys import chain_keys, namespace_seed  # noqa: E402
from kvkeeper.connector.layout import KVLayout  # noqa: E402
from kvkeeper.connector.link import DaemonLink  # noqa: E402
from kvkeeper.connector.load.halves import HalvesLoad  # noqa: E402
from kvkeeper.connector.metadata import KVKeeperConnectorMetadata, LoadSpec, SaveSpec  # noqa: E402
from kvkeeper.connector.worker import WorkerSide  # noqa: E402

BS = 32
NUM_BLOCKS = 12


def layout():
    return KVLayout(layer_names=("l0", "l1"), num_heads=2, block_tokens=BS,
                         content_bytes=64 * 4, dtype="float32", physical="LBHNC",
                         spec_kind="FullAttentionSpec")


def namespace() -> dict:
    lay = layout()
    return {"model_id": "worker-test", "model_revision": "", "dtype": "float32",
            "kv_layout": lay.layout_string(), "block_tokens": BS,
            "block_bytes": lay.block_bytes, "tp_rank": 0, "tp_size": 1}


def tensors(seed: int) -> Dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {n: torch.randn(NUM_BLOCKS, 2, BS, 64, generator=g) for n in ("l0", "l1")}


@pytest.fixture
def daemon() -> Iterator[DaemonProcess]:
    d = short_tmpdir()
    proc = DaemonProcess(f"{d}/kvk.sock", capacity="16MiB", page="32KiB").start()
    yield proc
    proc.cleanup()
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(params=["inline", "halves", "beside"])
def placement(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """inline: no spare core, loads are copied and checked before start_load_kv
    returns. beside: as in a CPU worker with a reserved core: copies and
    checks run on the I/O thread while wait_for_layer_load paces the layers."""
    import kvkeeper.connector.worker as worker_mod

    cpus = frozenset({"inline": (), "halves": (0,), "beside": (0, 1)}[request.param])
    monkeypatch.setattr(worker_mod, "spare_cpus", lambda: cpus)
    monkeypatch.setattr(HalvesLoad, "min_blocks", 2)
    return request.param


def worker(url: str, kv: Dict[str, torch.Tensor], transport: str = "auto", **cfg):
    c = ConnectorConfig(url=url, reconnect_min_s=0.2, reconnect_max_s=0.5, **cfg)
    link = DaemonLink(url, namespace(), instance_id="worker-test", timeout=2.0,
                           reconnect_min_s=0.2, reconnect_max_s=0.5, transport=transport,
                           checksum=c.checksum)
    w = WorkerSide(c, layout(), 0, link)
    w.register_kv_caches(kv, NUM_BLOCKS)
    # register_kv_caches connects on the I/O thread; a load meanwhile finds the
    # link "connecting" and misses. In vLLM a worker loads only after the
    # scheduler got a hit, long after; here the first load may come at once.
    deadline = time.monotonic() + 10.0
    while w.usable and not link.connected and time.monotonic() < deadline:
        time.sleep(0.01)
    return w


def keys(n: int, salt: int = 0) -> Tuple[bytes, ...]:
    toks = [salt * 100000 + i for i in range(n * BS)]
    return tuple(chain_keys(namespace_seed(namespace()), toks, BS))


def save(w, ks, block_ids) -> None:
    meta = KVKeeperConnectorMetadata(saves=[SaveSpec("r", (tuple(ks),), tuple(block_ids))])
    w.wait_for_save(meta)
    assert w.flush(10.0)


def load(w, ks, block_ids, load_id: int = 1, during_forward=None, **spec):
    meta = KVKeeperConnectorMetadata(loads=[LoadSpec("r", (tuple(ks),), tuple(block_ids),
                                                               load_id=load_id, **spec)])
    w.start_load_kv(meta)
    if during_forward is not None:
        during_forward()
    for name in ("l0", "l1"):   # as the attention layers do, in order
        w.wait_for_layer_load(name)
    errors = w.take_load_errors()
    w.flush(10.0)
    return errors, w.build_worker_meta()


@pytest.mark.parametrize("transport", ["auto", "stream"])
def test_saved_blocks_load_into_other_block_ids(daemon: DaemonProcess, transport: str,
                                               placement: str) -> None:
    """auto: shared memory (same host); stream: the bytes travel over gRPC."""
    src, dst = tensors(1), tensors(2)
    a, b = worker(daemon.url, src, transport), worker(daemon.url, dst, transport)
    try:
        ks = keys(3)
        save(a, ks, [4, 7, 1])
        assert daemon.stats().tiers[0].blocks == 3
        client, matches = b.link.client(), []
        real_match = client.match
        client.match = lambda *args, **kw: (matches.append(args), real_match(*args, **kw))[1]
        errors, wm = load(b, ks, [0, 9, 5])
        assert errors == set() and wm.loads_done == {1: {0: (3, ())}}
        # streamed: matched and streamed in one keyed LoadStream, no Match first
        assert len(matches) == (0 if transport == "stream" else 1), matches
        # the worker's observation point: the phases this load went through
        phases = set(b.load_timings.as_dict())
        assert {"fetch", "stream", "stream_first", "stream_copy"} <= phases \
            if transport == "stream" else {"fetch", "copy", "check"} <= phases, phases
        if placement == "halves" and transport == "auto":
            assert isinstance(b.load_strategy, HalvesLoad) and \
                b.load_timings.copy == b.load_timings.check, "the halves path ran"
        for name in ("l0", "l1"):
            for s, d in ((4, 0), (7, 9), (1, 5)):
                assert torch.equal(dst[name][d], src[name][s])
        sa, sb = a.take_stats().data, b.take_stats().data
        assert a.link.client().transport == ("shm" if transport == "auto" else "stream")
        assert sa["saved_blocks"] == 3 and sa["saved_bytes"] == 3 * layout().block_bytes
        assert sb["loaded_blocks"] == 3 and "load_errors" not in sb
        assert daemon.stats().leases == 0, "the worker released its lease"
        save(a, ks, [4, 7, 1])  # already there: nothing written
        assert a.take_stats().data == {"save_present_blocks": 3}
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("transport", ["auto", "stream"])
def test_missing_blocks_are_reported_from_the_first_gap(daemon: DaemonProcess,
                                                        placement: str, transport: str) -> None:
    src, dst = tensors(1), tensors(2)
    before = {n: t.clone() for n, t in dst.items()}
    a, b = worker(daemon.url, src), worker(daemon.url, dst, transport)
    try:
        ks = keys(4, salt=1)
        save(a, ks[:2], [0, 1])           # blocks 2 and 3 never stored
        errors, wm = load(b, ks, [5, 6, 7, 8])
        assert errors == {7, 8} and wm.loads_done == {1: {0: (2, ())}}
        assert torch.equal(dst["l0"][5], src["l0"][0]) and torch.equal(dst["l1"][7], before["l1"][7])
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("transport", ["auto", "stream"])
def test_a_corrupt_block_is_reported_and_dropped(daemon: DaemonProcess, placement: str,
                                                 transport: str) -> None:
    """stream: the block is checked in the KV cache as on the shm path."""
    src, dst = tensors(1), tensors(2)
    a, b = worker(daemon.url, src), worker(daemon.url, dst, transport)
    try:
        ks = keys(3, salt=2)
        save(a, ks, [0, 1, 2])
        corrupt_stored_block(daemon.socket_path, namespace(), ks[1])
        errors, wm = load(b, ks, [3, 4, 5])
        assert errors == {4, 5}, "the corrupt block and every block after it"
        assert wm.loads_done == {1: {0: (1, (1,))}}
        assert b.take_stats().data["checksum_errors"] == 1
        # the worker released with discard_indices=[1] and nobody else holds
        # it: that block alone is dropped
        m = a.link.call(lambda c: c.match(list(ks)), "lookup")
        assert m.matched == 1
    finally:
        a.shutdown()
        b.shutdown()


def stored_algos(w, ks) -> list:
    """The checksum algorithm each stored block of `ks` was committed with."""
    m = w.link.call(lambda c: c.match(list(ks), lease=True, blocks=True), "lookup")
    try:
        assert m.matched == len(ks) and len(m.blocks) == len(ks)
        return [r.checksum_algo for r in m.blocks]
    finally:
        w.link.call(lambda c: c.release(m.lease_id), "release")


@pytest.mark.parametrize("transport", ["auto", "stream"])
def test_crc32_blocks_of_an_old_config_load_and_corrupt_xxh3_is_refused(
        daemon: DaemonProcess, placement: str, transport: str) -> None:
    """Blocks saved by a connector configured before XXH3 (kvkeeper_checksum
    crc32) load and verify in one with the default; a corrupt XXH3 block is
    refused with everything after it."""
    from kvkeeper.v1 import kvkeeper_pb2 as pb

    src, dst = tensors(1), tensors(2)
    old, new = worker(daemon.url, src, checksum="crc32"), worker(daemon.url, src)
    b = worker(daemon.url, dst, transport)
    try:
        ks_old, ks_new = keys(3, salt=7), keys(3, salt=8)
        save(old, ks_old, [0, 1, 2])
        save(new, ks_new, [3, 4, 5])
        assert stored_algos(new, ks_old) == [pb.CHECKSUM_CRC32] * 3
        assert stored_algos(new, ks_new) == [pb.CHECKSUM_XXH3_64] * 3
        errors, wm = load(b, ks_old, [6, 7, 8])
        assert errors == set() and wm.loads_done == {1: {0: (3, ())}}
        for name in ("l0", "l1"):
            for s, d in ((0, 6), (1, 7), (2, 8)):
                assert torch.equal(dst[name][d], src[name][s])
        corrupt_stored_block(daemon.socket_path, namespace(), ks_new[1])
        errors, wm = load(b, ks_new, [9, 10, 11], load_id=2)
        assert errors == {10, 11} and wm.loads_done == {2: {0: (1, (1,))}}
        assert b.take_stats().data["checksum_errors"] == 1
    finally:
        for w in (old, new, b):
            w.shutdown()


def test_daemon_down_means_every_block_recomputed_and_saves_dropped(daemon: DaemonProcess) -> None:
    src = tensors(1)
    a = worker(daemon.url, src)
    try:
        ks = keys(2, salt=3)
        save(a, ks, [0, 1])
        daemon.kill()
        t = time.monotonic()
        errors, wm = load(a, ks, [2, 3])
        assert errors == {2, 3} and wm.loads_done == {1: {0: (0, ())}}
        save(a, keys(2, salt=4), [0, 1])
        errors, _ = load(a, ks, [2, 3], load_id=2)
        assert errors == {2, 3}
        assert time.monotonic() - t < 5.0, "a dead daemon must not stall the worker"
        stats = a.take_stats().data
        assert stats["save_dropped_blocks"] >= 2 and stats["load_error_blocks"] == 4
    finally:
        a.shutdown()


def test_layout_mismatch_disables_but_still_answers_for_loads(daemon: DaemonProcess) -> None:
    bad = {n: torch.zeros(NUM_BLOCKS, 1, BS, 64) for n in ("l0", "l1")}  # 1 head, not 2
    w = worker(daemon.url, bad)
    try:
        assert w.disabled and "head slots" in w.disabled
        errors, wm = load(w, keys(2), [3, 4])
        assert errors == {3, 4} and wm.disabled == {0: w.disabled}
        _, wm2 = load(w, keys(2), [3, 4], load_id=2)
        assert wm2.disabled == {}, "reported once"
        save(w, keys(2), [0, 1])
        assert daemon.stats().tiers[0].blocks == 0
    finally:
        w.shutdown()


def test_queued_saves_are_copied_out_before_vllm_reuses_their_blocks(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """The save thread is stuck sending an earlier save; copy_out_for (vLLM is
    about to free or rewrite a request's blocks) copies that request's queued
    blocks itself, so what is stored is what the blocks held at save time."""
    import threading

    import kvkeeper.connector.save as save_mod

    src, dst = tensors(1), tensors(2)
    original = {n: t.clone() for n, t in src.items()}
    a, b = worker(daemon.url, src), worker(daemon.url, dst)
    gate, sending = threading.Event(), threading.Event()
    real_send = save_mod.SaveThread.send

    def slow_send(self, keys, rows, parent=None):
        sending.set()
        assert gate.wait(20.0)
        return real_send(self, keys, rows, parent)

    monkeypatch.setattr(save_mod.SaveThread, "send", slow_send)
    try:
        k1, k2 = keys(1, salt=7), keys(2, salt=8)
        a.wait_for_save(KVKeeperConnectorMetadata(saves=[
            SaveSpec("r1", (tuple(k1),), (0,)), SaveSpec("r2", (tuple(k2),), (5, 6))]))
        assert sending.wait(10.0)
        assert a.saves_pinning() == 1, "r2 is queued behind r1's send, not copied yet"
        a.copy_out_for({"r2"})
        assert a.saves_pinning() == 0
        for t in src.values():   # vLLM reuses the blocks
            t.zero_()
        gate.set()
        assert a.flush(10.0)
        errors, _ = load(b, k2, [1, 2])
        assert errors == set()
        for name in ("l0", "l1"):
            assert torch.equal(dst[name][1], original[name][5])
            assert torch.equal(dst[name][2], original[name][6])
    finally:
        gate.set()
        a.shutdown()
        b.shutdown()


def test_the_block_the_forward_writes_into_is_checked_before_the_forward(
        daemon: DaemonProcess, placement: str) -> None:
    """A hit of every token but the prompt's last loads the last block whole and
    vLLM writes that token's KV into it during the forward, values that may
    differ from the stored ones in the last bits: the block must be checked
    before the forward, or a good hit would look corrupt."""
    src, dst = tensors(1), tensors(2)
    a, b = worker(daemon.url, src), worker(daemon.url, dst)
    try:
        ks = keys(3, salt=9)
        save(a, ks, [0, 1, 2])

        def forward_writes_last_token() -> None:
            for name in ("l0", "l1"):   # in before start_load_kv returned
                assert torch.equal(dst[name][7], src[name][2])
            for t in dst.values():
                t[7, :, BS - 1, :] += 1e-6

        errors, wm = load(b, ks, [5, 6, 7], recomputes_last=True,
                          during_forward=forward_writes_last_token)
        assert errors == set() and wm.loads_done == {1: {0: (3, ())}}
        assert torch.equal(dst["l0"][5], src["l0"][0]) and torch.equal(dst["l1"][6], src["l1"][1])
    finally:
        a.shutdown()
        b.shutdown()


@pytest.mark.parametrize("spare,mode,beside,name", [
    (0, "auto", False, "inline"), (1, "auto", False, "halves"), (2, "auto", True, "beside"),
    (1, "on", True, "beside"), (0, "on", False, "inline"), (4, "off", False, "inline")])
def test_where_loads_are_copied(daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch,
                                spare: int, mode: str, beside: bool, name: str) -> None:
    import kvkeeper.connector.worker as worker_mod

    monkeypatch.setattr(worker_mod, "spare_cpus", lambda: frozenset(range(spare)))
    w = worker(daemon.url, tensors(1), load_overlap=mode)
    try:
        assert w.load_strategy.beside_forward is beside
        assert w.load_strategy.name == name
        # Saves copy with a thread per spare core, one where there is none
        # (a CPU engine's forward owns its cores); the client was made with it.
        assert w.link.copy_threads == max(1, spare)
        assert w.link.call(lambda c: c.copy_threads, "t") == max(1, spare)
    finally:
        w.shutdown()


def test_a_load_with_the_schedulers_refs_needs_no_rpc(daemon: DaemonProcess,
                                                      placement: str) -> None:
    """The scheduler's leased Match returned where the blocks lie; the worker
    copies them from shared memory without a Match of its own (its lease is
    the scheduler's). Refs from another arena are not used: it matches itself."""
    src, dst = tensors(1), tensors(2)
    a, b = worker(daemon.url, src), worker(daemon.url, dst)
    try:
        ks = keys(3, salt=11)
        save(a, ks, [2, 3, 4])
        sched = a.link.client()
        res = sched.match(list(ks), lease=True, blocks=True)
        assert res.matched == 3 and len(res.blocks) == 3
        client = b.link.client()
        matches = []
        real_match = client.match
        client.match = lambda *x, **k: matches.append(x) or real_match(*x, **k)
        errors, wm = load(b, ks, [6, 7, 8], refs=(tuple(stored(res.blocks)),),
                          arena_ids=(sched.arena_id,))
        assert errors == set() and wm.loads_done == {1: {0: (3, ())}}
        assert matches == [], "no RPC of the worker's own"
        for name in ("l0", "l1"):
            assert torch.equal(dst[name][6:9], src[name][2:5])
        assert daemon.stats().leases == 1, "only the scheduler's lease"
        errors, _ = load(b, ks, [6, 7, 8], load_id=2, refs=(tuple(stored(res.blocks)),),
                         arena_ids=(b"another arena...",))
        assert errors == set() and len(matches) == 1, "another arena: it matched itself"
        sched.release(res.lease_id)
    finally:
        a.shutdown()
        b.shutdown()


def test_a_save_sends_the_key_before_its_first_block(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """SaveSpec.parents reach client.save (ReserveSave's parent_key), so the
    daemon links a chain saved step by step; an older scheduler's spec without
    them sends None (unknown)."""
    import kvkeeper.client.sync as sync_mod

    sent = []
    real_save = sync_mod.Client.save

    def recording_save(self, keys, blocks, parent=None):
        sent.append((list(keys), parent))
        return real_save(self, keys, blocks, parent)

    monkeypatch.setattr(sync_mod.Client, "save", recording_save)
    w = worker(daemon.url, tensors(1))
    try:
        ks = keys(4)
        w.wait_for_save(KVKeeperConnectorMetadata(saves=[
            SaveSpec("r", (ks[:2],), (0, 1), parents=(b"",)),
            SaveSpec("r", (ks[2:3],), (2,), parents=(ks[1],)),
            SaveSpec("r", (ks[3:],), (3,))]))
        assert w.flush(10.0)
        assert sent == [(list(ks[:2]), b""), ([ks[2]], ks[1]), ([ks[3]], None)]
        assert daemon.stats().tiers[0].blocks == 4
    finally:
        w.shutdown()


@pytest.mark.parametrize("clean", [True, False])
def test_a_save_computed_over_a_load_waits_for_its_outcome(daemon: DaemonProcess,
                                                           clean: bool) -> None:
    """With several ranks, blocks computed in a loading step are saved only once
    the scheduler says that load was clean (a later step's load_outcomes);
    after a failed one they are dropped: computed over bad KV, they would be
    stored for good."""
    kv = tensors(7)
    w = worker(daemon.url, kv)
    w._saver.waits_for_word = True   # as with several ranks: the scheduler's word rules
    try:
        ks = keys(2, salt=7)
        w.wait_for_save(KVKeeperConnectorMetadata(saves=[SaveSpec(
            "r", (tuple(ks),), (3, 4), after_loads=(41,))]))
        time.sleep(0.3)   # the save thread holds them, waiting for load 41
        pkv = tensors(8)
        probe = worker(daemon.url, pkv)
        errors, _ = load(probe, ks, (5, 6), load_id=9)
        assert errors == {5, 6}, "not stored before the outcome"
        # The next step's metadata says how load 41 went.
        w.wait_for_save(KVKeeperConnectorMetadata(load_outcomes={41: clean}))
        assert w.flush(10.0)
        errors, _ = load(probe, ks, (5, 6), load_id=10)
        assert errors == (set() if clean else {5, 6})
        if clean:
            for name in ("l0", "l1"):
                assert torch.equal(pkv[name][5:7], kv[name][3:5])
        probe.shutdown()
    finally:
        w.shutdown()


def test_an_abandoned_load_writes_nothing_after_its_blocks_are_reported(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch) -> None:
    """A copy job beside the forward that does not finish in time (the I/O
    thread busy with something else): its blocks are reported failed and
    vLLM recomputes them, so the job must never write into them afterwards
    (the scheduler's lease, which kept its arena pages, is released)."""
    import kvkeeper.connector.worker as worker_mod
    monkeypatch.setattr(worker_mod, "spare_cpus", lambda: frozenset({0, 1}))   # beside
    src, dst = tensors(1), tensors(2)
    a = worker(daemon.url, src)
    b = worker(daemon.url, dst, io_timeout_s=0.3, max_retries=0)
    try:
        assert b.load_strategy.name == "beside"
        ks = keys(3, salt=11)
        save(a, ks, [2, 3, 4])
        sched = a.link.client()
        res = sched.match(list(ks), lease=True, blocks=True)
        # The I/O thread is busy past both layers' waits and the settle's.
        busy = 4 * b._io.wait_s + 1.0
        b._io.submit(time.sleep, busy)
        b.start_load_kv(KVKeeperConnectorMetadata(loads=[LoadSpec(
            "r", (tuple(ks),), (6, 7, 8), load_id=1, refs=(tuple(stored(res.blocks)),),
            arena_ids=(sched.arena_id,))]))
        for name in ("l0", "l1"):
            b.wait_for_layer_load(name)
        assert b.take_load_errors() == {6, 7, 8}
        assert b.build_worker_meta().loads_done == {1: {0: (0, ())}}
        sched.release(res.lease_id)
        for n in ("l0", "l1"):
            dst[n][6:9] = src[n][2:5] * 2   # vLLM's recompute
        recomputed = {n: dst[n][6:9].clone() for n in ("l0", "l1")}
        time.sleep(busy)   # the I/O thread is free again
        assert all(torch.equal(dst[n][6:9], recomputed[n]) for n in ("l0", "l1"))
    finally:
        a.shutdown()
        b.shutdown()


def test_with_one_rank_a_save_over_a_clean_load_goes_at_once(daemon: DaemonProcess) -> None:
    """One rank knows its step's load outcome itself: a save computed over a
    clean load of that step is stored without waiting for the scheduler's
    word (vLLM may not step again before another request arrives)."""
    src, dst = tensors(3), tensors(4)
    a, b = worker(daemon.url, src), worker(daemon.url, dst)
    try:
        ks = keys(3, salt=3)
        save(a, ks[:2], [0, 1])
        meta = KVKeeperConnectorMetadata(
            loads=[LoadSpec("r", (tuple(ks[:2]),), (5, 6), load_id=7)],
            saves=[SaveSpec("r", (tuple(ks[2:]),), (7,), after_loads=(7,))])
        b.start_load_kv(meta)
        for name in ("l0", "l1"):
            b.wait_for_layer_load(name)
        b.wait_for_save(meta)       # no later step tells it anything
        assert b.flush(10.0)
        errors, _ = load(a, ks, (8, 9, 10), load_id=8)
        assert errors == set()
        # A load this rank never saw end is no clean one: dropped, not waited for.
        b.wait_for_save(KVKeeperConnectorMetadata(saves=[SaveSpec(
            "r", ((keys(1, salt=30)[0],),), (11,), after_loads=(99,))]))
        assert b.flush(2.0)
    finally:
        a.shutdown()
        b.shutdown()
