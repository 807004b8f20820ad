"""kvkeeper.connector.gpu's copy paths on CPU tensors with a fake ops object:
the bytes, and which stream waits for which event, in which order."""
from __future__ import annotations

import mmap
import os
import tempfile

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (it comes with vllm)")

from gpu_fakes import FakeOps, random_blocks, small_codec  # noqa: E402

from kvkeeper.client.arena_mapping import ArenaMapping, file_id  # noqa: E402
from kvkeeper.client.checksum import xxh3_64  # noqa: E402
from kvkeeper.client.pinned import PinnedArena  # noqa: E402
from kvkeeper.connector.gpu import cuda_load_strategy, device_saves_for, on_cuda  # noqa: E402
from kvkeeper.connector.gpu.d2h import DeviceSaves  # noqa: E402
from kvkeeper.connector.gpu.h2d import DeviceLoader, host_block_ok  # noqa: E402
from kvkeeper.connector.gpu.signals import LayerSignal  # noqa: E402
from kvkeeper.v1 import kvkeeper_pb2 as pb  # noqa: E402


def assert_holds(codec, kv, ids, blocks) -> None:
    """The KV cache holds blocks[j] at vLLM block ids[j] (read back by the
    CPU path's gather) and zeros everywhere else."""
    rows = codec.new_rows(len(ids))
    codec.gather(ids, rows)
    for j, b in enumerate(blocks):
        assert torch.equal(rows[j], b), j
    others = [i for i in range(8) if i not in ids]   # small_codec: 8 blocks
    rest = codec.new_rows(len(others))
    codec.gather(others, rest)
    assert not rest.any()


@pytest.mark.parametrize("split", [1, 2])
def test_copy_writes_the_blocks_and_arms_each_group(split) -> None:
    codec, kv = small_codec(layers=3, split=split)
    ops = FakeOps()
    dl = DeviceLoader(codec, ops, min_copy_bytes=2 * codec.layout.layer_bytes)
    assert dl.groups == [range(0, 2), range(2, 3)]
    blocks = random_blocks(codec, 3)
    ids = [5, 1, 6]
    signals = dl.signals()
    assert not any(s.is_set() for s in signals.values())
    last = dl.copy(ids, blocks, signals)
    assert_holds(codec, kv, ids, blocks)
    # the side stream first waits for the compute stream's work so far
    assert ops.log[0][:2] == ("record", "compute") and ops.log[1] == ("wait", "side",
                                                                      ops.log[0][2])
    side = [e[2] for e in ops.log if e[:2] == ("record", "side")]
    assert len(side) == 2 and last == side[-1]
    assert signals["l0"].event == signals["l1"].event == side[0]
    assert signals["l2"].event == side[1]
    # waiting for a layer is a stream wait on the compute stream, not a host wait
    n = len(ops.log)
    assert signals["l2"].wait(1.0)
    assert ops.log[n:] == [("wait", "compute", side[1])]
    assert not any(kind == "sync" for kind, *_ in ops.log)


def test_corrupt_host_bytes_are_refused_before_any_copy() -> None:
    codec, kv = small_codec()
    ops = FakeOps()
    dl = DeviceLoader(codec, ops)
    blocks = random_blocks(codec, 3)
    sums = [(pb.CHECKSUM_XXH3_64, xxh3_64(b.numpy())) for b in blocks]
    blocks[0][7] ^= 1    # the first block is corrupt: nothing may be copied
    good, bad, ev = dl.load_checked([0, 1, 2], blocks, lambda j: host_block_ok(blocks[j],
                                                                              sums[j]))
    assert (good, bad, ev) == (0, [0], None) and ops.log == []
    assert all(not t.any() for t in kv.values())
    # a corrupt middle block: only the blocks before it reach the KV cache
    blocks[0][7] ^= 1
    blocks[1][0] ^= 0xFF
    signals = dl.signals()
    good, bad, ev = dl.load_checked([0, 1, 2], blocks,
                                    lambda j: host_block_ok(blocks[j], sums[j]), signals)
    assert (good, bad) == (1, [1]) and ev is not None
    rows = codec.new_rows(3)
    codec.gather([0, 1, 2], rows)
    assert torch.equal(rows[0], blocks[0]) and not rows[1].any() and not rows[2].any()
    assert all(s.event == ev for s in signals.values())


def test_host_block_ok() -> None:
    b = torch.arange(64, dtype=torch.uint8)
    assert host_block_ok(b, (pb.CHECKSUM_XXH3_64, xxh3_64(b.numpy())))
    assert not host_block_ok(b, (pb.CHECKSUM_XXH3_64, xxh3_64(b.numpy()) ^ 1))
    assert host_block_ok(b, (pb.CHECKSUM_NONE, 0))
    assert not host_block_ok(b, (12345, 0))   # an algorithm unknown here is never trusted


def test_nothing_to_copy_sets_the_signals() -> None:
    codec, _ = small_codec()
    ops = FakeOps()
    dl = DeviceLoader(codec, ops)
    signals = dl.signals()
    assert dl.copy([], [], signals) is None
    assert all(s.is_set() for s in signals.values()) and ops.log == []
    with pytest.raises(ValueError):
        dl.copy([1, 2], random_blocks(codec, 1))


def test_layer_signal_never_armed_reports_a_failed_wait() -> None:
    ops = FakeOps()
    s = LayerSignal(ops)
    assert not s.is_set() and s.wait(0.1) is False and ops.log == []
    s.set()
    assert s.is_set() and s.wait(0.1) is True and ops.log == []


class _FakeRegistrar:
    def register(self, address, nbytes):
        pass

    def unregister(self, address):
        pass


def test_adjacent_blocks_in_the_pinned_arena_are_one_copy_each_run() -> None:
    codec, kv = small_codec(layers=2)
    bb = codec.block_bytes
    fd, path = tempfile.mkstemp()
    os.ftruncate(fd, 4096 + 4 * bb)
    mm = mmap.mmap(fd, 4096 + 4 * bb, flags=mmap.MAP_SHARED)
    m = ArenaMapping(path, 4096 + 4 * bb, b"i" * 16, 4096, bb * 4 // 4096, 4096,
                     file_id(os.fstat(fd)), mm)
    os.close(fd)
    os.unlink(path)
    pinned = PinnedArena(lambda: _FakeRegistrar())
    assert pinned.ensure(m)
    blocks = random_blocks(codec, 4)
    order = [0, 1, 3]     # slots 0, 1 adjacent; 3 alone
    for j, slot in enumerate(order):
        m.write([(4096 + slot * bb, bb)], blocks[j].numpy(), whole=True)
    sources = [torch.frombuffer(m.view(4096 + s * bb, bb), dtype=torch.uint8) for s in order]
    dl = DeviceLoader(codec, FakeOps(), pinned, min_copy_bytes=1 << 30)   # one whole-block group
    runs = dl._whole_runs(sources)
    assert [(j, k) for j, k, _ in runs] == [(0, 2), (2, 1)]
    dl.copy([4, 2, 7], sources)
    rows = codec.new_rows(3)
    codec.gather([4, 2, 7], rows)
    for j in range(3):
        assert torch.equal(rows[j], blocks[j])
    del sources, runs
    pinned.close()
    m.close()


def test_save_copy_out_orders_behind_the_forward_and_waits_only_on_the_host_side() -> None:
    codec, kv = small_codec()
    for t in kv.values():
        t.copy_(torch.randn_like(t))
    ops = FakeOps()
    order = DeviceSaves(ops).mark()          # vLLM's thread, after the forward
    fwd = order.event
    assert ops.log == [("record", "compute", fwd)] and order.stream == "compute"
    ops.cur = "default-of-save-thread"       # copy_out runs on the save thread
    rows = order.copy_out(codec, [3, 0])
    kinds = [(k, s) for k, s, *_ in ops.log]
    assert kinds[1] == ("wait", "side") and ops.log[1][2] == fwd
    gathered, copied = rows.gathered, rows.copied
    # the compute stream (not the save thread's) waits for the gather: the
    # blocks can be reused by later work only after they were read
    assert ops.log[-1] == ("wait", "compute", gathered)
    assert not any(k == "sync" for k, *_ in ops.log)
    host = rows.host()
    assert ops.log[-1] == ("sync", copied)
    want = codec.new_rows(2)
    codec.gather([3, 0], want)
    assert torch.equal(host, want)


def test_cpu_kv_cache_takes_no_gpu_path() -> None:
    codec, _ = small_codec()
    assert not on_cuda(codec) and device_saves_for(codec) is None

    class Loader:
        pass

    loader = Loader()
    loader.codec = codec
    assert cuda_load_strategy(loader, None, None) is None


class _Io:
    """IoThread's submit, run at once."""

    wait_s = 1.0

    def submit(self, fn, *args):
        from concurrent.futures import Future
        fut: Future = Future()
        fut.set_result(fn(*args))
        return fut


def test_cuda_load_strategy_checks_then_copies_and_releases_after_the_last_event() -> None:
    from types import SimpleNamespace

    from kvkeeper.connector.gpu.load import CudaLoad
    from kvkeeper.connector.load.copy_in import BlockLoader
    from kvkeeper.connector.load.step import FetchedLoad, StepLoads
    from kvkeeper.connector.load.timings import LoadTimings
    from kvkeeper.connector.stats import Counters

    codec, kv = small_codec()
    ops = FakeOps()
    loader = BlockLoader(codec, True, Counters(), None)
    strat = CudaLoad(loader, _Io(), DeviceLoader(codec, ops), None)
    assert loader.device is strat
    blocks = random_blocks(codec, 4)
    sums = [(pb.CHECKSUM_XXH3_64, xxh3_64(b.numpy())) for b in blocks]
    blocks[2][0] ^= 1                          # corrupt: block 2 and 3 are not copied
    spec = SimpleNamespace(req_id="r", block_ids=[4, 5, 6, 7])
    f = FetchedLoad(spec, None, 4, list(blocks), sums)
    step = StepLoads([f], strat.paced_layers(), LoadTimings())
    strat.start(step)
    assert (f.good, f.bad) == (2, [2]) and f.sources is None    # released
    assert isinstance(step.layer_done["l0"], LayerSignal)
    assert_holds(codec, kv, [4, 5], blocks[:2])
    last_side = [e[2] for e in ops.log if e[:2] == ("record", "side")][-1]
    assert ops.log[-1] == ("sync", last_side)   # released only after the last copy's event
    # the block the forward writes into: checked, then copied, the compute stream waiting
    good = random_blocks(codec, 1)
    f2 = FetchedLoad(SimpleNamespace(req_id="q", block_ids=[1]), None, 1, good,
                     [(pb.CHECKSUM_XXH3_64, xxh3_64(good[0].numpy()))])
    n = len(ops.log)
    loader.copy_in(f2, 0, 1)
    assert f2.checked == {0: True} and ops.log[-1][:2] == ("wait", "compute")
    assert_holds(codec, kv, [4, 5, 1], blocks[:2] + good)
    bad = random_blocks(codec, 1)
    f3 = FetchedLoad(SimpleNamespace(req_id="b", block_ids=[0]), None, 1, bad, [(pb.CHECKSUM_XXH3_64, 1)])
    n = len(ops.log)
    loader.copy_in(f3, 0, 1)
    assert f3.checked == {0: False} and ops.log[n:] == []    # refused before any copy


def test_save_job_on_a_device_copies_out_behind_the_forward() -> None:
    from kvkeeper.connector.save import SaveJob
    from kvkeeper.connector.stats import Counters

    codec, kv = small_codec()
    for t in kv.values():
        t.copy_(torch.randn_like(t))
    ops = FakeOps()
    job = SaveJob("r", [b"k" * 32], [3])
    job.device = DeviceSaves(ops).mark()
    job.copy_out(codec, Counters())
    assert job.copied and ops.log[-1] == ("wait", "compute", job.rows.gathered)
    job.copy_out(codec, Counters())            # once only
    host = job.rows.host()
    want = codec.new_rows(1)
    codec.gather([3], want)
    assert torch.equal(host, want) and ops.log[-1] == ("sync", job.rows.copied)
