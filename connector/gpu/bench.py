"""`kvkeeper bench gpu`: kvkeeper's host<->GPU load and save paths against raw torch copies.

    kvkeeper bench gpu [--json] [--quick]

Needs CUDA (torch.cuda.is_available()); without it the benchmark says so and
`kvkeeper bench` exits 1. No daemon and no vLLM: the bytes lie in an arena
file mapped the way a client maps the daemon's (kvkeeper.client's
ArenaMapping over a file in /dev/shm), registered as pinned memory by
PinnedArena, and the KV cache is a paged 6-layer GQA-shaped cache on the GPU
(the issue's M2: 4 KV heads of 64, fp32, 32-token blocks; 64 blocks = a
2048-token prompt, 24 MiB; 16 blocks with --quick). Blocks lie in the arena
in shuffled order (no two adjacent), the unfavourable case for the copy plan.

Per repetition, side by side (GB/s = 1e9 bytes per second; medians):
* gpu.load.h2d: DeviceLoader.load_checked: every block's XXH3-64 checked on
  the host, then the layer-group copies from the pinned arena and the
  scatter into the paged KV tensors on the side stream, until its last
  event completed. Baseline: one torch copy_ of the same bytes from a pinned
  tensor (torch.empty(pin_memory=True)) into a device tensor, synchronized.
* gpu.load.h2d_unchecked: the same without the checksum (the copy path alone).
* gpu.save.d2h: DeviceSaves: an event on the compute stream, the gather of
  the blocks on the side stream, the D2H copy into pinned host rows, waited
  for, then the rows' XXH3-64 on the host (what client.save computes before
  its commit; the daemon RPC and the copy into the arena are `bench data`'s).
  Baseline: one torch copy_ of the same bytes from a device tensor into a
  pinned tensor, synchronized.
ratio = kvkeeper / raw, higher is better; informational (issue 12 sets no
GPU target; the shared-memory paths' is >= 0.7x memcpy).
"""
from __future__ import annotations

import mmap
import os
import random
import tempfile
import time
from typing import Any, Callable, Dict, List

from kvkeeper.client.arena_mapping import ArenaMapping, file_id
from kvkeeper.client.checksum import xxh3_64
from kvkeeper.client.pinned import PinnedArena
from kvkeeper.server.bench.registry import BenchUnavailable
from kvkeeper.server.bench.result import Result, median
from kvkeeper.v1 import kvkeeper_pb2 as pb

__all__ = ["run"]

LAYERS, KV_HEADS, HEAD, BLOCK_TOKENS = 6, 4, 64, 32
PAGE = 4096


def _torch_cuda() -> Any:
    try:
        import torch
    except ImportError as e:
        raise BenchUnavailable(f"gpu needs torch with CUDA, and torch is not installed ({e})") \
            from e
    if not torch.cuda.is_available():
        raise BenchUnavailable(
            f"gpu needs CUDA: torch.cuda.is_available() is False (torch {torch.__version__}, "
            f"built for CUDA {torch.version.cuda or 'none'})")
    return torch


def _arena(nbytes: int) -> ArenaMapping:
    """An arena-like file mapping of nbytes of data after one header page."""
    where = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    fd, path = tempfile.mkstemp(prefix="kvkeeper-gpu-bench-", dir=where)
    try:
        size = PAGE + nbytes
        os.ftruncate(fd, size)
        mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=mmap.PROT_READ | mmap.PROT_WRITE)
        m = ArenaMapping(path, size, b"\0" * 16, PAGE, nbytes // PAGE, PAGE,
                         file_id(os.fstat(fd)), mm)
    finally:
        os.close(fd)
        os.unlink(path)    # stays mapped; nothing left behind
    return m


def _once(fn: Callable[[], None]) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def run(quick: bool = False, *, log: Callable[[str], None] = lambda s: None,
        python: Any = None) -> List[Result]:
    torch = _torch_cuda()
    from ..blocks import BlockCodec
    from ..layout import KVLayout
    from .d2h import DeviceSaves
    from .h2d import DeviceLoader, host_block_ok
    from .ops import CudaOps

    dev = torch.device("cuda", torch.cuda.current_device())
    n = 16 if quick else 64
    reps = 5 if quick else 15
    layout = KVLayout(layer_names=tuple(f"l{i}" for i in range(LAYERS)),
                      num_heads=2 * KV_HEADS, block_tokens=BLOCK_TOKENS, content_bytes=HEAD * 4,
                      dtype="float32", physical="bench", spec_kind="FullAttentionSpec")
    bb = layout.block_bytes
    num_blocks = 2 * n
    kv = {name: torch.zeros((num_blocks, 2 * KV_HEADS, BLOCK_TOKENS, HEAD), device=dev)
          for name in layout.layer_names}
    codec = BlockCodec(layout, kv, num_blocks)
    arena = _arena(2 * n * bb)
    pinned = PinnedArena()
    if not pinned.ensure(arena):
        raise RuntimeError("registering the arena as pinned memory failed (see the log)")
    rng = random.Random(0)
    slots = rng.sample(range(2 * n), n)   # shuffled, never adjacent in order
    data = os.urandom(bb)
    sources, sums = [], []
    for s in slots:
        off = PAGE + s * bb
        arena.write([(off, bb)], data[s % 97:] + data[:s % 97], whole=True)
        src = torch.frombuffer(arena.view(off, bb), dtype=torch.uint8)
        sources.append(src)
        sums.append((pb.CHECKSUM_XXH3_64, xxh3_64(src.numpy())))
    ids = list(range(n, 2 * n))
    total = n * bb
    log(f"gpu: {torch.cuda.get_device_name(dev)}, {n} blocks of {bb >> 10} KiB "
        f"({total / 2**20:.0f} MiB) per measurement, {reps} repetitions")

    loader = DeviceLoader(codec, CudaOps(dev), pinned)
    saves = DeviceSaves(CudaOps(dev))
    raw_host = torch.empty(total, dtype=torch.uint8, pin_memory=True)
    raw_host.copy_(torch.frombuffer(bytearray(os.urandom(total)), dtype=torch.uint8))
    raw_dev = torch.empty(total, dtype=torch.uint8, device=dev)

    def load(check: bool) -> Callable[[], None]:
        def go() -> None:
            good, bad, ev = loader.load_checked(
                ids, sources, (lambda j: host_block_ok(sources[j], sums[j])) if check
                else (lambda j: True))
            if bad or good != n:
                raise RuntimeError(f"blocks {bad} failed their checksum in the benchmark")
            loader.ops.synchronize(ev)
        return go

    def raw_h2d() -> None:
        raw_dev.copy_(raw_host, non_blocking=True)
        torch.cuda.current_stream(dev).synchronize()

    def save() -> None:
        torch.cuda.current_stream(dev).synchronize()   # the "forward" is done
        rows = saves.mark().copy_out(codec, ids).host()
        arr = rows.numpy()
        for j in range(n):
            xxh3_64(arr[j])

    def raw_d2h() -> None:
        raw_host.copy_(raw_dev, non_blocking=True)
        torch.cuda.current_stream(dev).synchronize()

    samples: Dict[str, List[float]] = {k: [] for k in ("h2d", "h2d_u", "raw_h2d", "d2h",
                                                       "raw_d2h")}
    fns = {"h2d": load(True), "h2d_u": load(False), "raw_h2d": raw_h2d, "d2h": save,
           "raw_d2h": raw_d2h}
    for f in fns.values():
        f()   # warm: allocators, kernels, the pinned pages' first touch
    for _ in range(reps):   # interleaved, so drift hits both sides alike
        for k, f in fns.items():
            samples[k].append(_once(f))
    # bytes land where they should (a benchmark of wrong copies measures nothing)
    rows = saves.mark().copy_out(codec, ids).host()
    for j in (0, n - 1):
        if not torch.equal(rows[j], sources[j]):
            raise RuntimeError(f"block {j} came back different from the arena's bytes")
    pinned.close()
    arena.close()

    def gbps(k: str) -> float:
        return total / median(samples[k]) / 1e9

    params = {"device": torch.cuda.get_device_name(dev), "blocks": n, "block_bytes": bb,
              "bytes": total, "reps": reps, "layer_groups": len(loader.groups),
              "torch": torch.__version__, "cuda": torch.version.cuda}

    def res(name: str, k: str, base: str, base_name: str, note: str) -> Result:
        return Result(name=name, value=gbps(k), unit="GB/s", baseline_name=base_name,
                      baseline_value=gbps(base), better="higher", group="gpu",
                      params={**params, "samples_s": [round(x, 6) for x in samples[k]],
                              "baseline_samples_s": [round(x, 6) for x in samples[base]]},
                      note=note)

    return [
        res("gpu.load.h2d", "h2d", "raw_h2d", "torch copy_ pinned -> device, same bytes",
            "host XXH3-64 check, then side-stream H2D from the pinned arena + scatter"),
        res("gpu.load.h2d_unchecked", "h2d_u", "raw_h2d",
            "torch copy_ pinned -> device, same bytes", "the copy path without the check"),
        res("gpu.save.d2h", "d2h", "raw_d2h", "torch copy_ device -> pinned, same bytes",
            "side-stream gather + D2H into pinned rows, then host XXH3-64"),
    ]
