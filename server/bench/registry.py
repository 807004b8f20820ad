"""Which benchmarks `kvkeeper bench` knows, and where each one lives.

The daemon's own benchmarks (BENCHES, what `all` runs) are modules of this
package and need nothing beyond the daemon's dependencies. The vLLM
benchmarks (EXTRA_BENCHES: time to first token of engines with the
connector) drive vLLM engines, so they live with the connector, in
kvkeeper.connector.bench. They are named here by module path and imported
only when run, the way vLLM finds a connector by kv_connector_module_path:
nothing the daemon imports pulls in the connector, torch or vLLM.
"""
from __future__ import annotations

import importlib
from typing import Callable

from .result import Result

BENCH_MODULES = {  # what `all` runs, in this order
    "ledger": "kvkeeper.server.bench.ledger_bench",
    "control": "kvkeeper.server.bench.control_bench",
    "locate": "kvkeeper.server.bench.locate_bench",
    "checksum": "kvkeeper.server.bench.checksum_bench",
    "data": "kvkeeper.server.bench.data_bench",
    "disk": "kvkeeper.server.bench.disk_bench",
    "gc": "kvkeeper.server.bench.gc_bench",
    "policy": "kvkeeper.server.bench.policy_bench",
}
EXTRA_BENCH_MODULES = {  # run only by name: they need vLLM and torch (gpu: torch and CUDA)
    "ttft": "kvkeeper.connector.bench.ttft_bench",
    "stream-hit": "kvkeeper.connector.bench.stream_hit_bench",
    "gpu": "kvkeeper.connector.gpu.bench",   # needs torch with CUDA, not vLLM
}
# Daemon benchmarks run only by name, like the vLLM ones, because they start
# another project's server: cluster needs redis-server (or valkey-server) on PATH.
NAMED_BENCH_MODULES = {
    "cluster": "kvkeeper.server.bench.cluster_bench",
}
BENCHES = tuple(BENCH_MODULES)
EXTRA_BENCHES = tuple(EXTRA_BENCH_MODULES)
NAMED_BENCHES = tuple(NAMED_BENCH_MODULES)
VLLM_INSTALL = "pip install 'kvkeeper[vllm]'"


class BenchUnavailable(RuntimeError):
    """A benchmark cannot run in this environment (e.g. ttft without vLLM)."""


class BenchUsageError(ValueError):
    """The user asked a benchmark for something it cannot run (e.g. ttft --model
    with a file that is no Llama config): a usage error, before anything runs."""


def runner(name: str) -> Callable[..., list[Result]]:
    """The `run` function of benchmark `name`."""
    if name in BENCH_MODULES:
        return importlib.import_module(BENCH_MODULES[name]).run
    if name in NAMED_BENCH_MODULES:
        return importlib.import_module(NAMED_BENCH_MODULES[name]).run
    if name not in EXTRA_BENCH_MODULES:
        raise ValueError(f"unknown benchmark {name!r}")
    module = EXTRA_BENCH_MODULES[name]
    try:
        return importlib.import_module(module).run
    except ImportError as e:
        # Only a missing package is the user's environment; a broken import
        # inside the benchmark is a bug and keeps its traceback.
        if not (e.name and module.startswith(e.name)):
            raise
        raise BenchUnavailable(f"it needs {module} (the connector's benchmarks) and vLLM, "
                               f"and {e.name} is not installed: {VLLM_INSTALL}") from e


__all__ = ["BENCHES", "BENCH_MODULES", "EXTRA_BENCHES", "EXTRA_BENCH_MODULES", "NAMED_BENCHES",
           "NAMED_BENCH_MODULES", "VLLM_INSTALL",
           "BenchUnavailable", "BenchUsageError", "runner"]
