"""Control-plane benchmark: Match latency and throughput against a raw gRPC echo.

Both servers run in their own process (serve_helper.py), each on a unix
socket, each with uvloop when installed; the load runs here, on this
process's event loop (uvloop too), with the same concurrency and the same
number of calls against each.

* kvkeeper: `AsyncClient.match` of a 256-key chain of 32-byte keys, all
  present, no lease (the keys were saved beforehand), through the client
  library as a vLLM connector would call it: on the daemon's match lane
  (client/match_lane.py), as every client on its unix socket does.
* extra, informational: the same client with match_lane=False, i.e. the
  Match over gRPC, which is what a remote client (TCP) gets.
* baseline: a unary call on a bare grpc.aio server with a generic handler
  (no protobuf, no servicer), request 256 * 32 = 8192 bytes, response 8 bytes.
* extra, informational: the same Match through a bare generated stub with a
  prebuilt MatchRequest, which leaves out the client library's own work
  (key checks, request building, retry wrapper) and so splits the overhead
  between client library and daemon.

With C concurrent clients, C separate channels (and, for kvkeeper, C
sessions) each make calls back to back; a call's latency is measured around
its await. Kinds run in alternation over many short rounds (the order
reversed every other round), so drifts of the machine's load hit all alike.
p50/p99 over all calls of all rounds; ops/s = calls / wall time of the rounds.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Awaitable, Callable

import grpc

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc

from .result import Result, percentile
from .serve_helper import RAW_OPTIONS, RAW_SERVICE
from .servers import ServerProcess, SocketDir

CHAIN = 256
KEY_BYTES = 32
BLOCK_BYTES = 4096
PAGE_BYTES = 4096


@dataclass(frozen=True)
class Scale:
    concurrency: tuple[int, ...]
    calls: dict[int, int]        # calls per client per round, by concurrency
    rounds: int
    warmup: int                  # calls per client before timing

    @classmethod
    def for_mode(cls, quick: bool) -> "Scale":
        if quick:
            return cls(concurrency=(1, 16), calls={1: 150, 16: 12}, rounds=2, warmup=30)
        return cls(concurrency=(1, 16), calls={1: 150, 16: 12}, rounds=8, warmup=200)


Call = Callable[[], Awaitable[Any]]


async def load_calls(calls: list[Call], n: int, lat: list[float]) -> float:
    """Each of `calls` (one per client) n times back to back; wall seconds."""
    perf = time.perf_counter

    async def worker(call: Call) -> None:
        append = lat.append
        for _ in range(n):
            t0 = perf()
            await call()
            append(perf() - t0)

    t0 = perf()
    await asyncio.gather(*(worker(c) for c in calls))
    return perf() - t0


def _chain_keys() -> list[bytes]:
    return [(i + 1).to_bytes(KEY_BYTES, "big") for i in range(CHAIN)]


async def _run(scale: Scale, log: Callable[[str], None]) -> list[Result]:
    from kvkeeper.client.aio import AsyncClient

    keys = _chain_keys()
    payload = b"".join(keys)           # 8192 bytes, like the Match request's keys
    ns = {"model_id": "bench-control", "block_tokens": 16, "block_bytes": BLOCK_BYTES}
    results: list[Result] = []
    with SocketDir() as d, \
            ServerProcess.kvkeeper(d, capacity=4096 + 2 * CHAIN * PAGE_BYTES,
                                   page_bytes=PAGE_BYTES) as kvk, \
            ServerProcess.raw(d, buffer_bytes=1 << 20) as raw:
        log("control: servers up; saving the chain")
        seed = await AsyncClient.connect(kvk.url, ns, transport="shm", checksum="none",
                                         instance_id="bench-seed")
        try:
            blocks = [bytes(BLOCK_BYTES)] * CHAIN
            await seed.save(keys, blocks)
            if (await seed.match(keys)).matched != CHAIN:
                raise RuntimeError("bench setup: the saved chain does not match")
            for c in scale.concurrency:
                results += await _one_level(c, scale, kvk, raw, ns, keys, payload, log)
        finally:
            await seed.close()
    return results


async def _one_level(c: int, scale: Scale, kvk: ServerProcess, raw: ServerProcess,
                     ns: dict, keys: list[bytes], payload: bytes,
                     log: Callable[[str], None]) -> list[Result]:
    from kvkeeper.client.aio import AsyncClient

    clients = [await AsyncClient.connect(kvk.url, ns, transport="shm", checksum="none",
                                         instance_id=f"bench-{i}") for i in range(c)]
    grpc_clients = [await AsyncClient.connect(kvk.url, ns, transport="shm", checksum="none",
                                              instance_id=f"bench-grpc-{i}", match_lane=False)
                    for i in range(c)]
    raw_channels = [grpc.aio.insecure_channel(raw.target, options=RAW_OPTIONS) for _ in range(c)]
    stub_channels = [grpc.aio.insecure_channel(kvk.target, options=RAW_OPTIONS) for _ in range(c)]
    try:
        def client_call(cl: Any) -> Call:
            async def call() -> None:
                r = await cl.match(keys)
                if r.matched != CHAIN:
                    raise RuntimeError(f"matched {r.matched} of {CHAIN}")
            return call

        def stub_call(ch: grpc.aio.Channel, sid: str) -> Call:
            match = pb_grpc.KVKeeperStub(ch).Match
            req = pb.MatchRequest(session_id=sid, keys=keys, lease=False)

            async def call() -> None:
                r = await match(req)
                if r.matched != CHAIN:
                    raise RuntimeError(f"matched {r.matched} of {CHAIN}")
            return call

        def echo_call(ch: grpc.aio.Channel) -> Call:
            echo = ch.unary_unary(f"/{RAW_SERVICE}/Echo")

            async def call() -> None:
                await echo(payload)
            return call

        kinds: dict[str, list[Call]] = {
            "echo": [echo_call(ch) for ch in raw_channels],
            "client": [client_call(cl) for cl in clients],
            "client_grpc": [client_call(cl) for cl in grpc_clients],
            "stub": [stub_call(ch, cl.session_id) for ch, cl in zip(stub_channels, clients)],
        }
        lat: dict[str, list[float]] = {k: [] for k in kinds}
        wall = {k: 0.0 for k in kinds}
        log(f"control: {c} client(s): warm-up")
        for calls in kinds.values():
            await load_calls(calls, scale.warmup, [])
        n = scale.calls[c]
        log(f"control: {c} client(s): {scale.rounds} rounds of {c * n} calls per kind")
        for r in range(scale.rounds):
            order = list(kinds) if r % 2 == 0 else list(reversed(kinds))
            for k in order:
                wall[k] += await load_calls(kinds[k], n, lat[k])
    finally:
        for cl in clients + grpc_clients:
            await cl.close()
        for ch in raw_channels + stub_channels:
            await ch.close()

    total = c * scale.calls[c] * scale.rounds
    p = {k: {q: percentile(v, q) * 1e6 for q in (50, 99)} for k, v in lat.items()}
    ops = {k: total / wall[k] for k in kinds}
    params = {"concurrency": c, "calls": total, "chain_keys": CHAIN, "request_bytes": len(payload),
              "transport": "unix socket", "rounds": scale.rounds}
    echo_name = f"grpc.aio echo, {len(payload)} B in, 8 B out"
    out = [
        Result(name=f"control.match.p50_us.c{c}", value=p["client"][50], unit="us",
               baseline_name=f"{echo_name}: p50", baseline_value=p["echo"][50], better="lower",
               target="<= 1.3", params=params,
               note="Match of a 256-key chain through AsyncClient (on the match lane), no lease"),
        Result(name=f"control.match_grpc.p50_us.c{c}", value=p["client_grpc"][50], unit="us",
               baseline_name=f"{echo_name}: p50", baseline_value=p["echo"][50], better="lower",
               params=params,
               note="the same Match through AsyncClient with match_lane=False: over gRPC, "
                    "as a remote client's"),
        Result(name=f"control.match.p99_us.c{c}", value=p["client"][99], unit="us",
               baseline_name=f"{echo_name}: p99", baseline_value=p["echo"][99], better="lower",
               params=params),
        Result(name=f"control.match.ops_per_s.c{c}", value=ops["client"], unit="ops/s",
               baseline_name=f"{echo_name}: ops/s", baseline_value=ops["echo"], better="higher",
               params=params),
        Result(name=f"control.match_stub.p50_us.c{c}", value=p["stub"][50], unit="us",
               baseline_name=f"{echo_name}: p50", baseline_value=p["echo"][50], better="lower",
               params=params,
               note="the same Match through a bare stub with a prebuilt request: "
                    "daemon + protobuf cost without the client library's"),
    ]
    return out


def run(quick: bool = False, *, scale: Scale | None = None,
        log: Callable[[str], None] = lambda s: None) -> list[Result]:
    from .serve_helper import run_async

    return run_async(_run(scale or Scale.for_mode(quick), log))
