"""Locate benchmark: where a 256-key chain is, with 8 engines reporting, against
a raw gRPC echo (issue 14).

Both servers run in their own process (serve_helper.py), as in the control
benchmark. In the daemon, 8 sessions of one namespace each report a
residency: engine i holds the chain's first 32 * i keys (one the whole
chain), and the host tier holds the first half. Then, alternating over
short rounds with the echo (the order reversed every other round), one
client calls Locate of the whole chain back to back: a generated stub with
a prebuilt request (the namespace's descriptor and the 256 keys), as a
router would; the echo sends the same 8 KiB of keys and gets 8 bytes back.
p50 over all calls of all rounds.
"""
from __future__ import annotations

from typing import Any, Callable

import grpc

from kvkeeper.v1 import kvkeeper_pb2 as pb
from kvkeeper.v1 import residency_pb2 as rpb
from kvkeeper.v1 import residency_pb2_grpc as rpb_grpc

from .control_bench import BLOCK_BYTES, CHAIN, PAGE_BYTES, Call, load_calls
from .result import Result, percentile
from .serve_helper import RAW_OPTIONS, RAW_SERVICE
from .servers import ServerProcess, SocketDir

ENGINES = 8


async def _run(rounds: int, calls: int, warmup: int, log: Callable[[str], None]) -> list[Result]:
    from kvkeeper.client.aio import AsyncClient

    keys = [(i + 1).to_bytes(32, "big") for i in range(CHAIN)]
    payload = b"".join(keys)
    ns = {"model_id": "bench-locate", "block_tokens": 16, "block_bytes": BLOCK_BYTES}
    with SocketDir() as d, \
            ServerProcess.kvkeeper(d, capacity=4096 + 2 * CHAIN * PAGE_BYTES,
                                   page_bytes=PAGE_BYTES) as kvk, \
            ServerProcess.raw(d, buffer_bytes=1 << 20) as raw:
        log(f"locate: servers up; {ENGINES} engines report")
        engines = [await AsyncClient.connect(kvk.url, ns, transport="shm", checksum="none",
                                             instance_id=f"bench-engine-{i}")
                   for i in range(ENGINES)]
        ch = grpc.aio.insecure_channel(kvk.target, options=RAW_OPTIONS)
        raw_ch = grpc.aio.insecure_channel(raw.target, options=RAW_OPTIONS)
        try:
            await engines[0].save(keys[:CHAIN // 2], [bytes(BLOCK_BYTES)] * (CHAIN // 2))
            for i, e in enumerate(engines):
                held = keys[:CHAIN * (i + 1) // ENGINES]
                await e.report_residency([("stored", held)], capacity_blocks=2 * CHAIN)
            locate = rpb_grpc.KVKeeperResidencyStub(ch).Locate
            req = rpb.LocateRequest(descriptor=pb.NamespaceDescriptor(**ns), keys=keys)
            first = await locate(req)
            prefixes = sorted(e.prefix for e in first.engines)
            if len(first.engines) != ENGINES or prefixes[-1] != CHAIN or first.stored != CHAIN // 2:
                raise RuntimeError(f"bench setup: Locate answered {first}")
            echo = raw_ch.unary_unary(f"/{RAW_SERVICE}/Echo")

            async def locate_call() -> None:
                await locate(req)

            async def echo_call() -> None:
                await echo(payload)

            kinds: dict[str, list[Call]] = {"echo": [echo_call], "locate": [locate_call]}
            lat: dict[str, list[float]] = {k: [] for k in kinds}
            for c in kinds.values():
                await load_calls(c, warmup, [])
            log(f"locate: {rounds} rounds of {calls} calls per kind")
            for r in range(rounds):
                for k in (list(kinds) if r % 2 == 0 else list(reversed(kinds))):
                    await load_calls(kinds[k], calls, lat[k])
        finally:
            for e in engines:
                await e.close()
            await ch.close()
            await raw_ch.close()
    p50 = {k: percentile(v, 50) * 1e6 for k, v in lat.items()}
    params = {"chain_keys": CHAIN, "engines": ENGINES, "calls": rounds * calls,
              "rounds": rounds, "concurrency": 1, "transport": "unix socket"}
    return [Result(name="locate.p50_us", value=p50["locate"], unit="us",
                   baseline_name=f"grpc.aio echo, {len(payload)} B in, 8 B out: p50",
                   baseline_value=p50["echo"], better="lower", params=params,
                   note=f"Locate of a {CHAIN}-key chain, {ENGINES} engines reporting, "
                        "through a generated stub")]


def run(quick: bool = False, *, log: Callable[[str], None] = lambda s: None,
        **_: Any) -> list[Result]:
    from .serve_helper import run_async

    rounds, calls, warmup = (2, 100, 30) if quick else (8, 150, 200)
    return run_async(_run(rounds, calls, warmup, log))
