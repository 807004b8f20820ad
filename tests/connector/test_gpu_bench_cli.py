"""`kvkeeper bench gpu` without CUDA: says it needs CUDA and exits non-zero."""
from __future__ import annotations

import subprocess
import sys

import pytest

torch = pytest.importorskip("torch", reason="torch is not installed (it comes with vllm)")


@pytest.mark.skipif(torch.cuda.is_available(), reason="CUDA is here: tests/gpu runs the bench")
def test_bench_gpu_needs_cuda() -> None:
    p = subprocess.run([sys.executable, "-m", "kvkeeper.server.cli", "bench", "gpu", "--quick"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 1, p.stderr
    assert "gpu cannot run here" in p.stderr and "needs CUDA" in p.stderr
    assert p.stdout == ""


def test_bench_gpu_is_registered() -> None:
    from kvkeeper.server.bench import build_parser
    from kvkeeper.server.bench.registry import EXTRA_BENCHES, runner

    assert "gpu" in EXTRA_BENCHES and build_parser().parse_args(["gpu"]).which == "gpu"
    assert callable(runner("gpu"))
