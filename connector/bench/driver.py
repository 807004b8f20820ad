"""The parent's side of engine.py: start engines, send commands, read answers.

Shared by the benchmarks (ttft_bench.py, stream_hit_bench.py) and the
connector's engine tests (tests/connector/connector_harness.py). Imports
neither vLLM nor torch: those are imported in the engine processes only,
which run on a Python that has them (`python`, see engine_python()).
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any, Callable, Dict, List, Mapping, Optional, Sequence

from kvkeeper.server.bench.registry import VLLM_INSTALL, BenchUnavailable

from .engine import PREFIX

ENGINE_MODULE = "kvkeeper.connector.bench.engine"
PYTHON_ENV = "KVKEEPER_BENCH_PYTHON"
READY_TIMEOUT_S = 600.0
CALL_TIMEOUT_S = 300.0


def engine_python() -> str:
    return os.environ.get(PYTHON_ENV) or sys.executable


def check_vllm(python: str) -> None:
    """BenchUnavailable unless `python` can import vLLM and torch."""
    code = ("import importlib.util, sys; "
            "sys.exit(0 if all(importlib.util.find_spec(m) for m in ('vllm', 'torch')) else 3)")
    try:
        r = subprocess.run([python, "-c", code], capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.SubprocessError) as e:
        raise BenchUnavailable(f"cannot run {python}: {e}") from e
    if r.returncode != 0:
        raise BenchUnavailable(
            f"it needs vLLM and torch in the engines' Python, and {python} lacks one or "
            f"both; install them ({VLLM_INSTALL}) or pass --engine-python PATH (or set "
            f"${PYTHON_ENV}) to a Python with vLLM")


def engine_env(base: Optional[Mapping[str, str]] = None) -> Dict[str, str]:
    env = dict(os.environ if base is None else base)
    env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")   # GiB; the benchmarks' models need little
    return env


class EngineProcess:
    """engine.py in its own process group (its engine core and workers too),
    one JSON command at a time. Start it, then wait_ready() (several engines
    start side by side: see start_engines)."""

    def __init__(self, args: Sequence[str], log_path: str, env: Optional[Dict[str, str]] = None,
                 python: Optional[str] = None, name: str = "") -> None:
        self.name = name
        self.log_path = log_path
        self._log = open(log_path, "w")
        cmd = [python or sys.executable, "-m", ENGINE_MODULE, *args]
        self.proc = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                     stderr=self._log, text=True,
                                     env=engine_env() if env is None else env,
                                     start_new_session=True)
        self._lines: "queue.Queue[Optional[str]]" = queue.Queue()
        self._owed = 0   # answers to commands sent that nobody has read yet
        threading.Thread(target=self._pump, name=f"engine-{name}", daemon=True).start()

    def _pump(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith(PREFIX):
                self._lines.put(line[len(PREFIX):])
            else:
                self._log.write(line)
        self._lines.put(None)

    def _who(self) -> str:
        return f"{self.name}: " if self.name else ""

    def log_tail(self, n: int = 4000) -> str:
        try:
            self._log.flush()
            return Path(self.log_path).read_text(errors="replace")[-n:]
        except (OSError, ValueError):
            return ""

    def answered(self) -> bool:
        """Whether an answer (or the engine's exit) waits to be read."""
        return not self._lines.empty()

    def read(self, timeout: float = CALL_TIMEOUT_S) -> Dict[str, Any]:
        """The next answer; an error answer raises RuntimeError."""
        try:
            line = self._lines.get(timeout=timeout)
        except queue.Empty:
            raise TimeoutError(f"{self._who()}no answer from the engine in {timeout:.0f} s; "
                               f"log {self.log_path}:\n{self.log_tail()}") from None
        self._owed = max(0, self._owed - 1)
        if line is None:
            raise RuntimeError(f"{self._who()}engine exited ({self.proc.poll()}); log "
                               f"{self.log_path}, tail:\n{self.log_tail()}")
        out = json.loads(line)
        if "error" in out:
            raise RuntimeError(f"{self._who()}engine error: {out['error']}\n"
                               f"{out.get('traceback', '')}")
        return out

    def wait_ready(self, timeout: float = READY_TIMEOUT_S) -> "EngineProcess":
        first = self.read(timeout)
        if not first.get("ready"):
            raise RuntimeError(f"{self._who()}engine did not start: {first}")
        return self

    def send(self, **cmd: Any) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(cmd) + "\n")
        self.proc.stdin.flush()
        self._owed += 1

    def call(self, timeout: float = CALL_TIMEOUT_S, **cmd: Any) -> Dict[str, Any]:
        """`cmd`'s answer. Answers still owed to earlier commands (sent by
        someone who stopped before reading them, e.g. a failed test) are read
        and dropped first: otherwise this call would return one of them."""
        while self._owed:
            try:
                self.read(timeout)
            except RuntimeError:
                if self.proc.poll() is not None:
                    raise
        self.send(**cmd)
        return self.read(timeout)

    def results(self, prompts: Sequence[Sequence[int]], timeout: float = CALL_TIMEOUT_S,
                **opts: Any) -> List[Dict[str, Any]]:
        """engine.py's generate: one result per prompt (opts: max_tokens, settle, batch,
        collect)."""
        return self.call(timeout, cmd="generate", prompts=[list(p) for p in prompts],
                         **opts)["results"]

    def one(self, prompt: Sequence[int], settle: float = 0.0) -> Dict[str, Any]:
        """One prompt alone, one token, after `settle` seconds and a full garbage
        collection (a timed request: no collection of earlier garbage inside it)."""
        return self.results([prompt], settle=settle, collect=True)[0]

    def metrics(self) -> Dict[str, float]:
        return self.call(cmd="metrics")["metrics"]

    def terminate(self, timeout: float = 60.0) -> int:
        """SIGTERM (how `vllm serve` is stopped) and wait for the exit; returns its code."""
        self.proc.send_signal(signal.SIGTERM)
        return self.proc.wait(timeout)

    def close(self) -> None:
        if self.proc.poll() is None:
            try:
                self.call(timeout=30, cmd="exit")
            except Exception:  # noqa: BLE001 - it is being stopped anyway
                pass
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                os.killpg(self.proc.pid, signal.SIGKILL)
                self.proc.wait(10)
        # the engine core and workers are in the engine's process group
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        self._log.close()


def start_engines(specs: Mapping[str, Sequence[str]], python: str, env: Dict[str, str],
                  logdir: str, log: Callable[[str], None], what: str,
                  timeout: float = READY_TIMEOUT_S) -> Dict[str, EngineProcess]:
    """One engine per spec (name -> engine.py arguments), started side by side
    and ready; its log in `logdir`/engine-<name>.log. On failure the ones
    started are closed."""
    t0 = time.perf_counter()
    log(f"{what}: starting {len(specs)} vLLM engines ({python})")
    engines: Dict[str, EngineProcess] = {}
    try:
        for name, args in specs.items():
            engines[name] = EngineProcess(args, os.path.join(logdir, f"engine-{name}.log"), env,
                                          python, name)
        with ThreadPoolExecutor(len(specs)) as pool:
            for f in [pool.submit(e.wait_ready, timeout) for e in engines.values()]:
                f.result()
    except BaseException:
        for e in engines.values():
            e.close()
        raise
    log(f"{what}: engines ready in {time.perf_counter() - t0:.0f}s")
    return engines
