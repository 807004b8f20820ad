"""The CUDA copy paths of kvkeeper.connector.gpu on a real GPU (skipped without CUDA).

Needs torch with CUDA, numpy, xxhash, protobuf and grpcio (kvkeeper.client);
not vLLM, not a daemon: the arena is a file mapping made the way a client
maps the daemon's. Run by tests/gpu/run.sh.
"""
from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from kvkeeper.client.checksum import xxh3_64  # noqa: E402
from kvkeeper.client.pinned import PinnedArena  # noqa: E402
from kvkeeper.connector.gpu.d2h import DeviceSaves  # noqa: E402
from kvkeeper.connector.gpu.h2d import DeviceLoader, host_block_ok  # noqa: E402
from kvkeeper.connector.gpu.ops import CudaOps  # noqa: E402

from cuda_kv import DEV, PAGE, arena, cuda_codec, fill, read_back  # noqa: E402


def test_arena_mapping_is_registered_once_and_unregistered() -> None:
    m = arena(64 * PAGE)
    p = PinnedArena()
    view = torch.frombuffer(m.view(PAGE, PAGE), dtype=torch.uint8)
    assert not view.is_pinned()
    assert p.ensure(m) and p.ensure(m)
    assert view.is_pinned()
    p.close()
    assert not view.is_pinned()
    del view
    m.close()


@pytest.mark.parametrize("split,permute", [(1, False), (2, False), (1, True)])
def test_async_h2d_of_a_block_set_into_a_paged_kv_cache(split, permute) -> None:
    codec, kv = cuda_codec(split=split, permute=permute)
    bb = codec.block_bytes
    m = arena(8 * bb)
    pinned = PinnedArena()
    assert pinned.ensure(m)
    sources, data, _ = fill(m, codec, [5, 6, 2, 0, 1])     # two runs of adjacent slots
    ids = [3, 9, 0, 15, 7]
    for min_copy in (0, 1 << 30):    # a group per layer; one whole-block group (runs)
        for t in kv.values():
            t.zero_()
        dl = DeviceLoader(codec, CudaOps(DEV), pinned, min_copy_bytes=min_copy)
        signals = dl.signals()
        last = dl.copy(ids, sources, signals)
        for name in codec.layer_names:     # what wait_for_layer_load does, layer by layer
            assert signals[name].wait(1.0)
        torch.cuda.current_stream(DEV).synchronize()
        assert last.query()
        rows = read_back(codec, ids)
        for j in range(len(ids)):
            assert torch.equal(rows[j], data[j]), (min_copy, j)
    pinned.close()
    del sources
    m.close()


def test_corrupt_host_bytes_are_refused_before_any_h2d() -> None:
    codec, kv = cuda_codec()
    bb = codec.block_bytes
    m = arena(4 * bb)
    sources, data, sums = fill(m, codec, [0, 1, 2])
    m.write([(PAGE + 7, 1)], bytes([data[0][7].item() ^ 1]), whole=True)   # the arena is corrupt
    dl = DeviceLoader(codec, CudaOps(DEV))
    good, bad, ev = dl.load_checked([1, 2, 3], sources,
                                    lambda j: host_block_ok(sources[j], sums[j]))
    assert (good, bad, ev) == (0, [0], None)
    torch.cuda.synchronize()
    assert all(not t.any() for t in kv.values())     # nothing reached the device
    del sources
    m.close()


def test_d2h_save_checksum_on_the_host() -> None:
    codec, kv = cuda_codec(split=2)
    for t in kv.values():       # "the forward": written on the compute stream
        t.copy_(torch.randn(t.shape, device=DEV))
    saves = DeviceSaves(CudaOps(DEV))
    order = saves.mark()
    rows = order.copy_out(codec, [4, 1, 11])
    host = rows.host()
    assert rows.copied.query() and host.device.type == "cpu" and host.is_pinned()
    want = read_back(codec, [4, 1, 11])
    for j in range(3):
        assert xxh3_64(host[j].numpy()) == xxh3_64(want[j].numpy())


def test_layer_copies_overlap_a_kernel_on_the_compute_stream() -> None:
    codec, _ = cuda_codec(layers=4, num_blocks=32, heads=8, tokens=32, head=256)
    bb = codec.block_bytes           # 1 MiB blocks, 256 KiB layers: a group per layer
    assert bb == 1 << 20
    m = arena(33 * bb)
    pinned = PinnedArena()
    assert pinned.ensure(m)
    sources, data, _ = fill(m, codec, list(range(0, 32)))
    dl = DeviceLoader(codec, CudaOps(DEV), pinned)
    assert len(dl.groups) == 4
    compute = torch.cuda.current_stream(DEV)
    torch.cuda.synchronize()
    signals = dl.signals()
    last = dl.copy(list(range(32)), sources, signals)
    assert signals["l0"].wait(1.0)   # layer 0's attention waits for layer 0 only
    torch.cuda._sleep(2_000_000_000)  # a long kernel standing in for that attention
    end = torch.cuda.Event()
    end.record(compute)
    last.synchronize()               # layers 1..3 are in ...
    assert not end.query(), "the later layers' copies waited for the kernel: no overlap"
    end.synchronize()                # ... while the kernel still ran
    rows = read_back(codec, list(range(32)))
    assert torch.equal(rows[31], data[31])
    pinned.close()
    del sources
    m.close()
