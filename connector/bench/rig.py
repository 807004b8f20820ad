"""What both vLLM benchmarks run on: a kvkeeper daemon, named engines, and
the pauses between their requests.

The daemon is the real one (kvkeeper.server.bench.servers: shared memory,
a unix socket, optionally TCP), the engines are engine.py processes
(driver.py), all on one model directory (model.py).
"""
from __future__ import annotations

import os
import shutil
import tempfile
from contextlib import contextmanager
from typing import Any, Callable, Dict, Iterator, List, Mapping, Optional, Sequence, Tuple

from kvkeeper.server.bench.servers import ServerProcess

from .driver import EngineProcess, engine_env, start_engines
from .model import BLOCK_TOKENS, MAX_MODEL_LEN
from .verify import SavedProbe

# Pauses before each request. Within one engine, earlier requests'
# background work (kvkeeper's saves and releases) ends. Between engines, the
# one that ran last stops spinning: vLLM's worker and engine core busy-poll
# their shared-memory queues (sched_yield) for 1 s after their last message
# (shm_broadcast.SpinCondition), which on a small machine would take CPU from
# the next engine's request. Every timed request waits as long, on its own
# engine too, so that each starts from the same state, every engine idle: one
# that finds its engine still spinning skips the wake-up. Measured (M1, 2048
# tokens, medians of 7): vLLM's own prefix hit took 15.5 ms 0.25 s after the
# prompt it served and 17.4 ms after 1.3 s, a kvkeeper hit 20.6 and 22.4 ms;
# the floor and ExampleConnector's load used to come 0.25 s after their
# engine's previous request, kvkeeper's hit after a switch.
SETTLE_S = 0.25
SWITCH_SETTLE_S = 1.3


@contextmanager
def scratch_dir(prefix: str, log: Callable[[str], None], what: str) -> Iterator[str]:
    """A short temporary directory (unix socket paths are limited to 108
    bytes) for the daemon, model and logs; removed afterwards, unless the
    run failed and $KVKEEPER_BENCH_KEEP is set (then its logs are kept)."""
    tmp = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    ok = False
    try:
        yield tmp
        ok = True
    finally:
        if ok or not os.environ.get("KVKEEPER_BENCH_KEEP"):
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            log(f"{what}: failed; logs kept in {tmp}")


def bench_env() -> Dict[str, str]:
    env = engine_env()
    # vLLM's CPU worker keeps one core for the engine core process and,
    # when a KV connector is configured, one more for the connector: on a
    # 2-core machine that leaves none, so it falls back to every core and
    # a connector engine would compute with twice the threads of the
    # recompute engine. The same reservation for all engines keeps the
    # compute alike (the connectors' threads share the reserved core).
    env.setdefault("VLLM_CPU_NUM_OF_RESERVED_CPU", "1")
    return env


def engine_args(model_dir: str, in_process: bool, max_model_len: int = MAX_MODEL_LEN) -> List[str]:
    """engine.py's arguments every benchmark engine shares: dummy weights,
    blocks of BLOCK_TOKENS, vLLM's prefix cache off (a hit can only come
    from the connector), a whole prompt in one step, and vLLM's hybrid KV
    cache manager off: KVKeeperConnector and ExampleConnector do not support
    it, so their engines run without it, and the engines without a connector
    do too, so that all keep the same blocks (on a sliding-window model
    vLLM's own cache would otherwise keep less than the whole prompt, and
    the floor would be another hit)."""
    args = ["--model", model_dir, "--block-size", str(BLOCK_TOKENS), "--max-model-len",
            str(max_model_len), "--max-num-batched-tokens", str(max_model_len), "--no-hybrid"]
    return args + (["--in-process"] if in_process else [])


class Rig:
    """A daemon and named engines; requests one at a time, each after its pause."""

    def __init__(self, tmp: str, log: Callable[[str], None], python: str, what: str) -> None:
        self.tmp = tmp
        self.log = log
        self.python = python
        self.what = what   # the benchmark's name, in progress lines and the probe's id
        self.daemon: Optional[ServerProcess] = None
        self.engines: Dict[str, EngineProcess] = {}
        self.probe: Optional[SavedProbe] = None
        self.last_engine = ""

    def start_daemon(self, capacity: int, tcp: str = "") -> str:
        """The daemon, with an arena of `capacity` bytes (also on `tcp`, a
        "host:port", if given); returns its unix socket URL."""
        self.daemon = ServerProcess.kvkeeper(self.tmp, capacity=capacity, page_bytes=64 << 10,
                                             tcp=tcp)
        self.daemon.start()
        self.probe = SavedProbe(self.daemon.url, f"kvkeeper bench {self.what}")
        return self.daemon.url

    def start_engines(self, specs: Mapping[str, Sequence[str]]) -> None:
        """The engines of `specs` (name -> engine.py arguments), side by side."""
        self.engines = start_engines(specs, self.python, bench_env(), self.tmp, self.log,
                                     self.what)

    def wait_saved(self, saved: Sequence[Tuple[Dict[str, Any], List[int]]]) -> None:
        assert self.probe is not None, "start_daemon first"
        self.probe.wait_saved(saved)

    def wait_held_by_peer(self, res: Dict[str, Any], tokens: List[int]) -> None:
        assert self.probe is not None, "start_daemon first"
        self.probe.wait_held_by_peer(res, tokens)

    def evict_all(self) -> None:
        """Drop every unreferenced block (admin Evict all): each round of a
        latency benchmark starts from an empty cache, so the arena's
        eviction policy never decides what is measured (S3-FIFO evicts a
        fresh, not yet hit prompt first: a round saving more than the arena's
        small queue would lose its own blocks)."""
        assert self.probe is not None, "start_daemon first"
        self.probe.evict_all()

    def timings_path(self, engine: str) -> str:
        return os.path.join(self.tmp, f"timings-{engine}.jsonl")

    def one(self, engine: str, prompt: Sequence[int], timed: bool = False) -> Dict[str, Any]:
        """`prompt` on `engine`, after its pause (above): SWITCH_SETTLE_S when
        `timed` or after another engine's request, else SETTLE_S."""
        settle = SETTLE_S if engine == self.last_engine and not timed else SWITCH_SETTLE_S
        self.last_engine = engine
        return self.engines[engine].one(prompt, settle=settle)

    def pids(self) -> List[int]:
        """This process and the daemon's (the engines have process groups of their own)."""
        pids = [os.getpid()]
        if self.daemon is not None and self.daemon.proc is not None:
            pids.append(self.daemon.proc.pid)
        return pids

    def close(self) -> None:
        if self.probe is not None:
            self.probe.close()
        for e in self.engines.values():
            e.close()
        if self.daemon is not None:
            self.daemon.stop()
