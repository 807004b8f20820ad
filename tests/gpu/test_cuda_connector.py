"""The connector's own CUDA hooks on a real GPU: CudaLoad (the load strategy
the worker picks for a KV cache on CUDA) and a SaveJob copied out on the
side stream. Skipped without CUDA. Without vLLM (a GPU machine with CUDA
torch only) the two vLLM base modules the connector's counters and metadata
import are stood in for (vllm_stubs.py)."""
from __future__ import annotations

from concurrent.futures import Future
from types import SimpleNamespace

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
import vllm_stubs  # noqa: E402

vllm_stubs.install_if_missing()

from kvkeeper.client.checksum import xxh3_64  # noqa: E402
from kvkeeper.client.pinned import PinnedArena  # noqa: E402
from kvkeeper.connector.gpu import cuda_load_strategy, device_saves_for  # noqa: E402
from kvkeeper.connector.gpu.load import CudaLoad  # noqa: E402
from kvkeeper.connector.load.copy_in import BlockLoader  # noqa: E402
from kvkeeper.connector.load.step import FetchedLoad, StepLoads  # noqa: E402
from kvkeeper.connector.load.timings import LoadTimings  # noqa: E402
from kvkeeper.connector.save import SaveJob  # noqa: E402
from kvkeeper.connector.stats import Counters  # noqa: E402

from cuda_kv import DEV, arena, cuda_codec, fill, read_back  # noqa: E402


class Io:
    wait_s = 5.0

    def submit(self, fn, *args):
        fut: Future = Future()
        fut.set_result(fn(*args))
        return fut


class Link:
    """DaemonLink.call over a client that only has the arena mapping."""

    def __init__(self, mapping) -> None:
        self.client = SimpleNamespace(arena_mapping=mapping)

    def call(self, fn, what, wait=True):
        return fn(self.client)


def test_cuda_load_pins_checks_copies_and_releases() -> None:
    codec, kv = cuda_codec(split=2)
    m = arena(8 * codec.block_bytes)
    sources, data, sums = fill(m, codec, [0, 1, 2, 3])
    loader = BlockLoader(codec, True, Counters(), None)
    strat = cuda_load_strategy(loader, Io(), Link(m))
    assert isinstance(strat, CudaLoad) and loader.device is strat
    spec = SimpleNamespace(req_id="r", block_ids=[9, 3, 12, 5])
    fetched = strat.fetch(lambda: [FetchedLoad(spec, None, 4, list(sources), sums)])
    assert isinstance(strat.device.pinned, PinnedArena) and strat.device.pinned.mapping is m
    assert sources[0].is_pinned()
    m.write([(4096 + 3 * codec.block_bytes, 1)], bytes([data[3][0].item() ^ 1]), whole=True)
    step = StepLoads(fetched, strat.paced_layers(), LoadTimings())
    strat.start(step)
    for name in codec.layer_names:      # what the worker's wait_for_layer_load does
        ev = step.layer_done[name]
        assert ev.is_set() or ev.wait(1.0)
    step.future.result(timeout=5)
    f = fetched[0]
    assert (f.good, f.bad) == (3, [3]) and f.sources is None
    rows = read_back(codec, [9, 3, 12, 5])
    for j in range(3):
        assert torch.equal(rows[j], data[j])
    assert not rows[3].any()              # the corrupt block never reached the GPU
    strat.close()
    assert strat.device.pinned.mapping is None and not sources[0].is_pinned()
    del sources
    m.close()


def test_save_job_copies_out_on_the_side_stream() -> None:
    codec, kv = cuda_codec()
    for t in kv.values():
        t.copy_(torch.randn(t.shape, device=DEV))
    saves = device_saves_for(codec)
    job = SaveJob("r", [b"k" * 32], [7, 2])
    job.device = saves.mark()
    job.copy_out(codec, Counters())
    host = job.rows.host()
    want = read_back(codec, [7, 2])
    assert [xxh3_64(host[j].numpy()) for j in range(2)] == \
        [xxh3_64(want[j].numpy()) for j in range(2)]
