"""Same-host peers on a GPU: a holder process's KV cache opened by CUDA IPC in
this process, blocks copied device to device under the holder's generations,
a reuse forced between the copy and its check, and the holder's death
(skipped without CUDA). Run by tests/gpu/run.sh.

The holder runs in a spawned process (one GPU, two processes): it fills its
two layers with block b of layer l = 100 * l + b, exports each layer's
handle (connector/peer/cuda_ipc.py) and its generation array's path, then
serves commands: reuse blocks (bump, then overwrite them), or exit.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import queue
import signal
import time
from typing import Any, List

import pytest

torch = pytest.importorskip("torch")
pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")

from kvkeeper.connector.peer.cuda_ipc import copy_blocks, export_kv, import_kv  # noqa: E402
from kvkeeper.connector.peer.gens import Generations  # noqa: E402

N, H, T, C = 16, 4, 32, 64


def holder_main(path: str, out: Any, cmds: Any) -> None:
    gens, fd = Generations.open_named(path, N)
    os.close(fd)
    gens.attach()
    layers = []
    for layer in range(2):
        t = torch.empty(N, H, T, C, device="cuda")
        for b in range(N):
            t[b].fill_(100 * layer + b)
        layers.append(t)
    torch.cuda.synchronize()
    out.put([export_kv(t) for t in layers])
    while True:
        cmd = cmds.get()
        if cmd[0] == "exit":
            return
        if cmd[0] == "reuse":   # what the holder's scheduler and forward do, in order
            gens.bump(cmd[1])
            for t in layers:
                t[cmd[1]] = -1.0
            torch.cuda.synchronize()
            out.put("reused")


@pytest.fixture
def holder(tmp_path: Any) -> Any:
    ctx = mp.get_context("spawn")
    out, cmds = ctx.Queue(), ctx.Queue()
    path = str(tmp_path / "gens")
    proc = ctx.Process(target=holder_main, args=(path, out, cmds), daemon=True)
    proc.start()
    handles = None
    for _ in range(24):              # up to 120 s, but not once the holder died
        try:
            handles = out.get(timeout=5)
            break
        except queue.Empty:
            if not proc.is_alive():
                pytest.fail(f"the holder process died at start (exit code {proc.exitcode})")
    if handles is None:
        proc.kill()
        pytest.fail("the holder process sent no handles within 120 s")
    gens = Generations(os.open(path, os.O_RDONLY), N, writable=False)
    yield proc, handles, gens, out, cmds
    if proc.is_alive():
        cmds.put(("exit",))
        proc.join(30)
    if proc.is_alive():
        proc.kill()
    gens.close()


def ours() -> List[torch.Tensor]:
    return [torch.zeros(N, H, T, C, device="cuda") for _ in range(2)]


def test_a_peer_copies_the_holders_blocks_through_cuda_ipc(holder: Any) -> None:
    _, handles, gens, _, _ = holder
    src = [import_kv(h) for h in handles]
    dst = ours()
    assert copy_blocks(src, dst, [3, 7, 11], [0, 1, 2], gens, [0, 0, 0]) == 3
    for layer in range(2):
        for i, b in enumerate([3, 7, 11]):
            assert bool((dst[layer][i] == 100 * layer + b).all())
    del src


def test_a_reuse_between_the_copy_and_its_check_is_detected(holder: Any) -> None:
    _, handles, gens, out, cmds = holder
    src = [import_kv(h) for h in handles]
    dst = ours()

    def holder_reuses_block_5() -> None:
        cmds.put(("reuse", [5]))
        assert out.get(timeout=60) == "reused"

    got = copy_blocks(src, dst, [2, 5, 6], [0, 1, 2], gens, [0, 0, 0],
                      after_copy=holder_reuses_block_5)
    assert got == 1, "block 5 was reused while it was copied: it and what follows are dropped"
    assert copy_blocks(src, dst, [2, 5], [0, 1], gens, [0, 0]) == 1   # stale before the copy
    del src


def test_a_holder_that_died_costs_no_hang_and_no_wrong_block(holder: Any) -> None:
    proc, handles, gens, _, _ = holder
    src = [import_kv(h) for h in handles]
    os.kill(proc.pid, signal.SIGKILL)
    proc.join(30)
    dst = ours()
    t = time.monotonic()
    try:
        got = copy_blocks(src, dst, [1, 2], [0, 1], gens, [0, 0])
    except RuntimeError:   # a CUDA error from the dead holder's memory: a miss
        got = 0
    assert time.monotonic() - t < 30
    for i, b in enumerate([1, 2][:got]):   # whatever was kept is the holder's block
        for layer in range(2):
            assert bool((dst[layer][i] == 100 * layer + b).all())
    del src
