"""Same-host peers on vLLM's CPU build: engine B loads a prefix that only
engine A's KV cache holds, straight from A's shared memory.

One daemon, two engines in their own processes, both with kvkeeper_peer.
Each test's prompt is computed by A (its greedy tokens are the recompute
reference), its blocks then dropped from the daemon's host tier (what a
host tier too small to keep them does), so only A's cache holds them. A has
a small KV cache (72 blocks) so that two long prompts reuse all of it. B's
copies can be paused after their first layer (source.py's test hook) while
the test makes A reuse the blocks, or kills A.
Set KVKEEPER_TEST_KEEP_LOGS=1 to keep the engines' and the daemon's logs.
"""
from __future__ import annotations

import os
import random
import shutil
import signal
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Dict, Iterator, List, Tuple

import pytest

from connector_harness import (DaemonProcess, EngineProcess, report_keys, short_tmpdir,
                               vllm_unavailable)

pytestmark = pytest.mark.skipif(vllm_unavailable() is not None,
                                reason=vllm_unavailable() or "")

STARTUP_S = 900.0
A_BLOCKS = 72
PEER = {"kvkeeper_peer": True}


def prompt(name: str, n: int) -> List[int]:
    rng = random.Random(name)
    return [rng.randrange(3, 500) for _ in range(n)]


def one(engine: EngineProcess, tokens: List[int], max_tokens: int = 8) -> Dict[str, Any]:
    r = engine.generate([tokens], max_tokens)
    return {"tokens": r["outputs"][0], "report": r["reports"][0]}


def wait_for(cond: Any, what: str, timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


@dataclass
class Peers:
    tmp: str
    daemon: DaemonProcess
    a: EngineProcess
    b: EngineProcess
    pause: str
    client: Any = None
    peer_client: Any = None

    def connect(self, namespace: Dict[str, Any]) -> None:
        from kvkeeper.client import Client
        from kvkeeper.client.peer import PeerClient
        from kvkeeper.client.peer_wire import peer_socket_path

        if self.client is None:
            self.client = Client.connect(self.daemon.url, namespace, instance_id="tests",
                                         timeout=5.0)
            self.peer_client = PeerClient(peer_socket_path(self.daemon.socket_path))

    def stored(self, keys: List[bytes]) -> int:
        return self.client.match(keys, report_use=True).matched

    def held_by_peers(self, keys: List[bytes]) -> int:
        return self.peer_client.match(self.client.session_id, "tests", keys).matched

    def held_by_a_only(self, name: str, n: int) -> Tuple[List[int], Dict[str, Any], List[bytes]]:
        """A computes a prompt; its blocks are then dropped from the host tier."""
        p = prompt(name, n)
        a = one(self.a, p)
        self.connect(a["report"]["kvkeeper"]["namespace"])
        keys = report_keys(a["report"], p)
        wait_for(lambda: self.stored(keys) == len(keys), "A's saves")
        m = self.client.match(keys, lease=True, report_use=True)
        self.client.release(m.lease_id, discard=True)
        assert self.stored(keys) == 0
        wait_for(lambda: self.held_by_peers(keys) == len(keys), "A's published blocks")
        return p, a, keys

    def pause_next_copy(self) -> None:
        open(os.path.join(self.pause, "arm"), "w").close()

    def wait_paused(self) -> None:
        wait_for(lambda: os.path.exists(os.path.join(self.pause, "paused")), "B's copy", 120)
        os.unlink(os.path.join(self.pause, "paused"))

    def resume(self) -> None:
        open(os.path.join(self.pause, "go"), "w").close()

    def close(self) -> None:
        for c in (self.client, self.peer_client):
            if c is not None:
                c.close()
        for e in (self.a, self.b):
            e.close()
        self.daemon.cleanup()


@pytest.fixture(scope="module")
def peers() -> Iterator[Peers]:
    from tiny_llama import write_tiny_llama

    tmp = short_tmpdir()
    model = f"{tmp}/model"
    write_tiny_llama(model)
    pause = f"{tmp}/pause"
    os.mkdir(pause)
    daemon = DaemonProcess(f"{tmp}/kvk.sock", capacity="128MiB", page="32KiB",
                           log_path=f"{tmp}/daemon.log").start()
    try:
        with ThreadPoolExecutor(2) as pool:
            fa = pool.submit(EngineProcess, model, daemon.url, f"{tmp}/engine-a.log",
                             ready_timeout=STARTUP_S, extra=PEER,
                             args=["--num-blocks", str(A_BLOCKS)])
            fb = pool.submit(EngineProcess, model, daemon.url, f"{tmp}/engine-b.log",
                             env={"KVKEEPER_TEST_PEER_PAUSE": pause},
                             ready_timeout=STARTUP_S, extra=PEER)
            started = []
            for f in (fa, fb):
                try:
                    started.append(f.result())
                except BaseException:
                    for e in started:
                        e.close()
                    raise
    except BaseException:
        daemon.cleanup()
        raise
    p = Peers(tmp, daemon, started[0], started[1], pause)
    try:
        yield p
    finally:
        p.close()
        if os.environ.get("KVKEEPER_TEST_KEEP_LOGS"):
            print(f"peer engine test logs kept in {tmp}")
        else:
            shutil.rmtree(tmp, ignore_errors=True)


def counter(engine: EngineProcess, name: str) -> float:
    return engine.metrics().get(f"vllm:kvkeeper_{name}", 0)


def test_b_loads_a_prefix_only_as_cache_holds(peers: Peers) -> None:
    p, a, keys = peers.held_by_a_only("peer-hit", 330)    # 10 full blocks
    loaded = counter(peers.b, "peer_loaded_blocks")
    b = one(peers.b, p)
    assert b["report"]["kvkeeper"]["hit_tokens"] == 320
    assert b["tokens"] == a["tokens"], "B's greedy tokens differ from A's recompute"
    assert counter(peers.b, "peer_loaded_blocks") - loaded == 10
    assert counter(peers.b, "load_error_blocks") == 0
    assert peers.stored(keys) == 0, "the blocks came from A's cache, not the host tier"


def test_a_block_reused_mid_copy_is_detected_and_recomputed(peers: Peers) -> None:
    p, a, keys = peers.held_by_a_only("forced-reuse", 330)
    stale = counter(peers.b, "peer_stale_blocks")
    errors = counter(peers.b, "load_error_blocks")
    peers.pause_next_copy()
    peers.b.send(cmd="generate", prompts=[p], max_tokens=8, batch=True)
    peers.wait_paused()
    # Two prompts of 64 blocks each take every block of A's 72 (71 usable).
    for i in range(2):
        one(peers.a, prompt(f"filler-{i}", 2016), 1)
    assert peers.held_by_peers(keys) == 0, "the daemon still offers A's reused blocks"
    peers.resume()
    b = peers.b.result()
    assert b["outputs"][0] == a["tokens"], "B used KV that A overwrote"
    moved = counter(peers.b, "peer_stale_blocks") - stale
    assert moved > 0, "the reuse under the copy was not detected"
    assert counter(peers.b, "load_error_blocks") - errors == moved


def test_a_holder_killed_mid_copy_costs_no_error_and_no_hang(peers: Peers) -> None:
    p, a, keys = peers.held_by_a_only("holder-killed", 330)
    peers.pause_next_copy()
    peers.b.send(cmd="generate", prompts=[p], max_tokens=8, batch=True)
    peers.wait_paused()
    os.killpg(peers.a.proc.pid, signal.SIGKILL)
    peers.a.proc.wait(30)
    # Its sessions end with its connections: the daemon forgets its segment.
    wait_for(lambda: peers.held_by_peers(keys) == 0, "the daemon to forget A", 10)
    t = time.monotonic()
    peers.resume()
    b = peers.b.result(timeout=60)
    assert time.monotonic() - t < 30
    # The copy finished from the mapping B still holds: A's generations no
    # longer move, so what it read is what A had published.
    assert b["outputs"][0] == a["tokens"]
