"""Helpers of the connector tests: a daemon subprocess, an engine subprocess, and
direct access to stored blocks (to corrupt or rewrite them).

Engines are the benchmarks' engine processes (kvkeeper.connector.bench.engine,
driven by its driver) on the tiny seeded-weight Llama of tiny_llama.py, run
with this interpreter, so vLLM must import here; `vllm_unavailable()` says
why not (the tests skip with that reason).
"""
from __future__ import annotations

import functools
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any, Callable, Dict, List, Optional, Sequence

import grpc

from kvkeeper.connector.bench import driver


@functools.lru_cache(maxsize=None)
def vllm_unavailable() -> Optional[str]:
    """None when `import vllm` (and torch) works in this interpreter, else why not.

    Checked in a subprocess: importing vLLM here would slow every other test
    and a broken install (e.g. a torchvision that does not match torch) only
    shows on import.
    """
    try:
        r = subprocess.run([sys.executable, "-c", "import torch, vllm"], capture_output=True,
                           text=True, timeout=300)
    except Exception as e:  # noqa: BLE001
        return f"cannot run {sys.executable}: {e}"
    if r.returncode != 0:
        last = (r.stderr.strip().splitlines() or ["?"])[-1]
        return f"`import vllm` fails in {sys.executable}: {last}"
    return None


def short_tmpdir() -> str:
    # unix socket paths are limited to 108 bytes
    return tempfile.mkdtemp(prefix="kvkc-", dir="/tmp")


# ---------------------------------------------------------------- daemon


class DaemonProcess:
    """`kvkeeper serve` on a unix socket, as a subprocess that tests may kill."""

    def __init__(self, socket_path: str, capacity: str = "128MiB", page: str = "64KiB",
                 log_path: Optional[str] = None, metrics: str = "", tcp: str = "",
                 extra_args: Sequence[str] = ()) -> None:
        self.socket_path = socket_path
        self.extra_args = list(extra_args)  # more `kvkeeper serve` flags, e.g. --set k=v
        self.metrics = metrics  # "host:port" of /metrics; "" disables it
        self.tcp = tcp          # "host:port" to listen on besides the socket; "" for none
        self.url = f"unix://{socket_path}"
        self.capacity = capacity
        self.page = page
        self.log_path = log_path or socket_path + ".log"
        self.proc: Optional[subprocess.Popen] = None
        self.shm_names: List[str] = []

    def start(self, timeout: float = 30.0) -> "DaemonProcess":
        name = f"kvkeeper-test-{uuid.uuid4().hex[:12]}"
        self.shm_names.append(name)
        log = open(self.log_path, "a")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "kvkeeper.server.cli", "serve", "--socket", self.socket_path,
             "--tcp", self.tcp, "--metrics", self.metrics, "--capacity", self.capacity,
             "--page-size", self.page, "--set", f"host_tier.name={name}", *self.extra_args],
            stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {self.proc.returncode}: "
                                   f"{Path(self.log_path).read_text()[-2000:]}")
            try:
                self.stats()
                return self
            except grpc.RpcError:
                time.sleep(0.1)
        raise RuntimeError("daemon did not start in time")

    def stats(self) -> Any:
        from kvkeeper.v1 import kvkeeper_pb2 as pb
        from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

        with grpc.insecure_channel(f"unix:{self.socket_path}") as ch:
            # generous: a CI host running three engines can stall the daemon for seconds
            return pb_grpc.KVKeeperStub(ch).Stats(pb.StatsRequest(), timeout=10.0)

    def kill(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(10)

    def pause(self) -> None:
        """SIGSTOP: the daemon hangs (a slow or stuck daemon) until resume()."""
        assert self.proc is not None
        self.proc.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self.proc is not None
        self.proc.send_signal(signal.SIGCONT)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)

    def cleanup(self) -> None:
        self.stop()
        for name in self.shm_names:  # a killed daemon leaves its segment behind
            try:
                os.unlink(os.path.join("/dev/shm", name))
            except FileNotFoundError:
                pass


# ---------------------------------------------------------------- engine


class EngineProcess(driver.EngineProcess):
    """An engine of the tiny Llama (seeded weights in `model_dir`, vLLM's
    prefix cache on), with KVKeeperConnector when `url` is given; started
    and ready. generate() and result() answer {"outputs": [token ids per
    prompt], "reports": [kv_transfer_params per prompt]}."""

    def __init__(self, model_dir: str, url: str = "", log_path: Optional[str] = None,
                 env: Optional[Dict[str, str]] = None, ready_timeout: float = 300.0,
                 extra: Optional[Dict[str, Any]] = None, args: Sequence[str] = ()) -> None:
        args = ["--model", model_dir, "--weights", "checkpoint", "--prefix-caching",
                "--max-model-len", "2048", *args]
        if url:
            args += ["--connector", "kvkeeper", "--url", url, "--report",
                     "--extra", json.dumps(extra or {})]
        full_env = driver.engine_env()
        full_env.update(env or {})
        super().__init__(args, log_path or os.path.join(model_dir,
                                                        f"engine-{uuid.uuid4().hex[:6]}.log"),
                         full_env)
        self.wait_ready(ready_timeout)

    def result(self, timeout: float = 120.0) -> Dict[str, Any]:
        """The answer to a generate sent with send()."""
        results = self.read(timeout)["results"]
        return {"outputs": [r["tokens"] for r in results],
                "reports": [r["params"] for r in results]}

    def generate(self, prompts: Sequence[Sequence[int]], max_tokens: int,
                 timeout: float = 120.0,
                 kv_transfer_params: Optional[Dict[str, Any]] = None) -> Dict[str, Any]:
        """All prompts in one batch (one llm.generate), `max_tokens` each, each
        with `kv_transfer_params` when given."""
        extra = {"kv_transfer_params": kv_transfer_params} if kv_transfer_params else {}
        self.send(cmd="generate", prompts=[list(p) for p in prompts], max_tokens=max_tokens,
                  batch=True, **extra)
        return self.result(timeout)


def start_engines(model_dir: str, urls: Sequence[tuple[str, str]], tmp: str,
                  ready_timeout: float) -> List[EngineProcess]:
    """EngineProcess(model_dir, url) for each (name, url), started side by side
    (logs in tmp/engine-<name>.log); if one fails to start, the others that
    did are closed before its error is raised."""
    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(len(urls)) as pool:
        futs = [pool.submit(EngineProcess, model_dir, url, f"{tmp}/engine-{name}.log",
                            ready_timeout=ready_timeout) for name, url in urls]
        engines = []
        for f in futs:
            try:
                engines.append(f.result())
            except BaseException:
                for g in futs:
                    if g.done() and g.exception() is None:
                        g.result().close()
                raise
        return engines


# ---------------------------------------------------------------- stored blocks


def report_keys(report: Dict[str, Any], tokens: Sequence[int]) -> List[bytes]:
    """The keys of the full blocks of `tokens`, from a request's kvkeeper report."""
    from kvkeeper.connector.keys import chain_keys

    info = report["kvkeeper"]
    return chain_keys(bytes.fromhex(info["seed"]), list(tokens), int(info["block_tokens"]))


def corrupt_stored_block(socket_path: str, namespace: Dict[str, Any], key: bytes,
                         offset_in_block: int = 1000) -> str:
    """Flip one byte of the stored block `key` directly in the daemon's arena
    file (found through Match + Load extents); the daemon keeps the checksum
    it was given at commit. Returns the arena path."""
    from kvkeeper.v1 import kvkeeper_pb2 as pb
    from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

    with grpc.insecure_channel(f"unix:{socket_path}") as ch:
        stub = pb_grpc.KVKeeperStub(ch)
        reg = stub.RegisterSession(pb.RegisterSessionRequest(
            instance_id="test-corrupter", namespace=pb.NamespaceDescriptor(**namespace)), timeout=5)
        sid = reg.session_id
        try:
            m = stub.Match(pb.MatchRequest(session_id=sid, keys=[key], lease=True), timeout=5)
            assert m.matched == 1, "the block to corrupt is not stored"
            ld = stub.Load(pb.LoadRequest(session_id=sid, lease_id=m.lease_id), timeout=5)
            ext = ld.blocks[0].extents[0]
            assert offset_in_block < ext.length
            with open(reg.arena.path, "r+b") as f:
                f.seek(ext.offset + offset_in_block)
                b = f.read(1)
                f.seek(ext.offset + offset_in_block)
                f.write(bytes([b[0] ^ 0xFF]))
            stub.Release(pb.ReleaseRequest(session_id=sid, lease_id=m.lease_id), timeout=5)
        finally:
            stub.CloseSession(pb.CloseSessionRequest(session_id=sid), timeout=5)
    return reg.arena.path


def rewrite_stored_blocks(url: str, namespace: Dict[str, Any], keys: Sequence[bytes],
                          transform: Callable[[int, bytes], bytes]) -> int:
    """Replace the stored blocks `keys` with transform(i, old bytes), through
    the client (so the new checksums are right): load, discard, save again.
    Returns how many blocks were rewritten."""
    from kvkeeper.client import Client

    c = Client.connect(url, namespace, instance_id="test-rewriter", timeout=5.0)
    try:
        m = c.match(list(keys), lease=True)
        assert m.matched == len(keys), f"only {m.matched} of {len(keys)} blocks are stored"
        old = c.load(m.lease_id)
        c.release(m.lease_id, discard=True)
        assert c.match(list(keys)).matched == 0, "the old blocks were not dropped"
        new = [transform(i, bytes(b)) for i, b in enumerate(old)]
        assert all(len(n) == len(o) for n, o in zip(new, old))
        res = c.save(list(keys), new)
        assert res.committed == len(keys), res
        return res.committed
    finally:
        c.close()
