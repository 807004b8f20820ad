"""Checks that every hit a benchmark measures really happened (or it fails).

A figure of a hit that did not load is a figure of something else. Each
check is a function that says what is wrong (None: nothing); expect_*
raise VerificationError with it, and the benchmark stops (stream-hit, and
the ttft matrix's warm-ups), while the ttft matrix's timed repetitions
collect the problems and fail the case's results with them (ttft_checks.py).
"""
from __future__ import annotations

import time
from typing import Any, Dict, List, Optional, Sequence, Tuple

import grpc

from kvkeeper.client import Client
from kvkeeper.client.url import to_grpc_target
from kvkeeper.v1.admin_pb2 import EvictRequest
from kvkeeper.v1.admin_pb2_grpc import KVKeeperAdminStub
from kvkeeper.connector.keys import chain_keys


class VerificationError(RuntimeError):
    """A hit the benchmark relies on did not happen: its figures would be wrong."""


def kvk_hit(res: Dict[str, Any]) -> int:
    """The hit tokens of a request's kvkeeper report (kv_transfer_params)."""
    rep = (res.get("params") or {}).get("kvkeeper")
    if not rep:
        raise VerificationError(f"no kvkeeper report in kv_transfer_params: {res.get('params')}")
    return int(rep["hit_tokens"])


def hits_problem(what: str, got: Sequence[int], want: int) -> Optional[str]:
    """What is wrong unless every request of `got` reported `want` hit tokens."""
    bad = [g for g in got if g != want]
    if not bad:
        return None
    return (f"{what}: expected {want} hit tokens in every request, got {list(got)}; the "
            f"figures would not measure a hit")


def loaded_blocks_problem(who: str, res: Dict[str, Any], hit_tokens: int,
                          want_blocks: int) -> Optional[str]:
    """What is wrong unless the worker's timing lines of request `res` show
    `want_blocks` loaded."""
    loads = [t for t in res.get("timings") or () if t.get("event") == "load"]
    blocks = sum(t["blocks"] for t in loads)
    if blocks == want_blocks:
        return None
    return (f"{who}'s worker loaded {blocks} blocks for a hit of {hit_tokens} tokens "
            f"({len(loads)} load lines); expected {want_blocks}")


def tokens_problem(what: str, got: Sequence[int], want: Sequence[int]) -> Optional[str]:
    """What is wrong unless a hit's greedy tokens are the ones recompute gave
    for the same prompt (KV that loaded wrong shows here)."""
    if list(got) == list(want):
        return None
    return f"{what}: greedy tokens {list(got)} differ from recompute's {list(want)}"


def load_counters_problem(who: str, before: Dict[str, float], after: Dict[str, float],
                          want_blocks: int) -> Optional[str]:
    """What is wrong unless an engine's counters grew by `want_blocks` loaded
    blocks and no error."""
    def delta(name: str) -> float:
        return after.get(f"vllm:kvkeeper_{name}", 0) - before.get(f"vllm:kvkeeper_{name}", 0)

    if delta("loaded_blocks") == want_blocks and not delta("load_error_blocks") \
            and not delta("checksum_errors"):
        return None
    return (f"{who}'s counters: loaded_blocks +{delta('loaded_blocks'):.0f} (expected "
            f"+{want_blocks}), load_error_blocks +{delta('load_error_blocks'):.0f}, "
            f"checksum_errors +{delta('checksum_errors'):.0f}")


def _raise(problem: Optional[str]) -> None:
    if problem is not None:
        raise VerificationError(problem)


def expect_hits(what: str, got: Sequence[int], want: int) -> None:
    _raise(hits_problem(what, got, want))


def expect_loaded_blocks(who: str, res: Dict[str, Any], hit_tokens: int,
                         want_blocks: int) -> None:
    """The worker's timing lines of request `res` show `want_blocks` loaded."""
    _raise(loaded_blocks_problem(who, res, hit_tokens, want_blocks))


def expect_load_counters(who: str, before: Dict[str, float], after: Dict[str, float],
                         want_blocks: int) -> None:
    """An engine's counters grew by `want_blocks` loaded blocks and no error."""
    _raise(load_counters_problem(who, before, after, want_blocks))


class SavedProbe:
    """The daemon's view of what an engine saved, through a client of its own."""

    def __init__(self, url: str, instance_id: str) -> None:
        self.url = url
        self.instance_id = instance_id
        self.client: Any = None
        self.peers: Any = None

    def _session(self, info: Dict[str, Any]) -> Any:
        """The probe's client, connected on first use to the namespace of an
        engine's report (`info`: its "kvkeeper" part)."""
        if self.client is None:
            self.client = Client.connect(self.url, info["namespace"],
                                         instance_id=self.instance_id, timeout=5.0)
        return self.client

    def stored(self, report: Dict[str, Any], tokens: Sequence[int]) -> Tuple[int, int]:
        """(blocks of `tokens` the daemon holds, full blocks of `tokens`)."""
        info = report["kvkeeper"]
        client = self._session(info)
        keys = chain_keys(bytes.fromhex(info["seed"]), list(tokens), int(info["block_tokens"]))
        # report_use: a probe, not a lookup or hit of the daemon's counters.
        return client.match(keys, report_use=True).matched, len(keys)

    def wait_saved(self, saved: Sequence[Tuple[Dict[str, Any], List[int]]],
                   timeout: float = 60.0) -> None:
        """Saves are sent in the background: wait until every full block of
        each (request result, tokens) pair is committed in the daemon."""
        deadline = time.monotonic() + timeout
        for res, tokens in saved:
            while True:
                got, want = self.stored(res["params"], tokens)
                if got >= want:
                    break
                if time.monotonic() > deadline:
                    raise VerificationError(f"only {got} of {want} blocks of a prompt were "
                                            f"saved within {timeout:.0f} s")
                time.sleep(0.02)

    def wait_held_by_peer(self, res: Dict[str, Any], tokens: Sequence[int],
                          timeout: float = 30.0) -> None:
        """Wait until another engine's KV cache publishes every full block of
        `tokens` (request result `res`) to the daemon's peer registry: a
        peer hit has something to copy (the holder publishes after its step)."""
        from kvkeeper.client.peer import PeerClient
        from kvkeeper.client.peer_wire import peer_socket_path

        info = res["params"]["kvkeeper"]
        session_id = self._session(info).session_id
        keys = chain_keys(bytes.fromhex(info["seed"]), list(tokens), int(info["block_tokens"]))
        if self.peers is None:
            self.peers = PeerClient(peer_socket_path(self.url.removeprefix("unix://")))
        deadline = time.monotonic() + timeout
        while True:
            got = self.peers.match(session_id, self.instance_id, keys).matched
            if got >= len(keys):
                return
            if time.monotonic() > deadline:
                raise VerificationError(f"a peer's cache published only {got} of {len(keys)} "
                                        f"blocks of a prompt within {timeout:.0f} s")
            time.sleep(0.02)

    def evict_all(self) -> None:
        """Evict every unreferenced block, through the daemon's admin API."""
        with grpc.insecure_channel(to_grpc_target(self.url)) as channel:
            KVKeeperAdminStub(channel).Evict(EvictRequest(all=True), timeout=30.0)

    def close(self) -> None:
        client: Optional[Any] = self.client
        self.client = None
        if self.peers is not None:
            self.peers.close()
            self.peers = None
        if client is not None:
            try:
                client.close()
            except Exception:  # noqa: BLE001 - closing after the measurement
                pass
