"""Data-plane benchmark: save and load throughput, by block size.

One daemon runs in its own process (serve_helper.py) with an arena of twice
the bytes one measurement moves, in pages of 256 KiB; a raw grpc.aio server
runs in another. For each block size (256 KiB, 1 MiB, 4 MiB) the same N
blocks (N * block = 256 MiB, 32 MiB with --quick) of preallocated numpy
memory move each way; GB/s is 1e9 bytes per second.

* shm (transport="shm", checksum="none"): `save(keys, blocks)` with fresh
  keys (ReserveSave, copy into the arena, CommitSave), then, untimed,
  `match(keys, lease=True)`; timed `load_into(lease, outs)` into preallocated
  buffers (Load, copy out of the arena); then, untimed, `release`.
  Baseline: `np.copyto` block by block between two preallocated arrays of the
  same shape (one memcpy of the same bytes: the floor for any copy-in/out).
  Target >= 0.6x.
* shm with checksum="crc32": the same, with CRC32 computed at save and
  verified at load. Informational, against the same memcpy.
* stream (transport="stream", checksum="none"): save through
  ReserveSave + WriteBlocks (client stream, chunks of the client's
  WRITE_CHUNK_BYTES) + CommitSave; load through LoadStream (chunks of the
  daemon's STREAM_CHUNK_BYTES) into the same preallocated buffers.
  Baseline: the raw server's client-streaming Sink (save) and
  server-streaming Source (load) with the same chunk sizes over the same kind
  of socket: messages are bare bytes; the sender makes each chunk with one
  copy, the receiver copies each into a preallocated buffer, as storing or
  loading the bytes requires. Target >= 0.8x.

The arena is written through once before timing so that no measurement pays
for first-touch page faults; every kind gets an untimed warm-up; kinds
alternate within each repetition and the median repetition is reported.
"""
from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass
from typing import Any, Callable

import numpy as np

from .result import Result, median
from .serve_helper import RAW_OPTIONS, RAW_SERVICE, SOURCE_REQ, U64
from .servers import ServerProcess, SocketDir

KiB, MiB = 1 << 10, 1 << 20
PAGE_BYTES = 256 * KiB
KEY_BYTES = 32


@dataclass(frozen=True)
class Scale:
    block_sizes: tuple[int, ...]
    move_bytes: int
    reps: int

    @classmethod
    def for_mode(cls, quick: bool) -> "Scale":
        if quick:
            return cls(block_sizes=(256 * KiB, 1 * MiB, 4 * MiB), move_bytes=32 * MiB, reps=1)
        return cls(block_sizes=(256 * KiB, 1 * MiB, 4 * MiB), move_bytes=256 * MiB, reps=3)


def _size_label(n: int) -> str:
    return f"{n // MiB}MiB" if n % MiB == 0 else f"{n // KiB}KiB"


class _Keys:
    def __init__(self) -> None:
        self.next = 1

    def take(self, n: int) -> list[bytes]:
        out = [i.to_bytes(KEY_BYTES, "big") for i in range(self.next, self.next + n)]
        self.next += n
        return out


def _gbps(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9


async def _run(scale: Scale, log: Callable[[str], None]) -> list[Result]:
    from kvkeeper.client.aio import WRITE_CHUNK_BYTES, AsyncClient
    from kvkeeper.server.api.servicer import STREAM_CHUNK_BYTES
    import grpc

    move = scale.move_bytes
    capacity = 4096 + 2 * move
    results: list[Result] = []
    keys = _Keys()
    with SocketDir() as d, \
            ServerProcess.kvkeeper(d, capacity=capacity, page_bytes=PAGE_BYTES) as kvk, \
            ServerProcess.raw(d, buffer_bytes=move) as raw:
        channel = grpc.aio.insecure_channel(raw.target, options=RAW_OPTIONS)
        sink = channel.stream_unary(f"/{RAW_SERVICE}/Sink")
        source = channel.unary_stream(f"/{RAW_SERVICE}/Source")
        try:
            first = True
            for bs in scale.block_sizes:
                n = move // bs
                label = _size_label(bs)
                log(f"data: {label} blocks, {n} per measurement")
                src = np.empty((n, bs), dtype=np.uint8)
                src[:] = 0x5A
                src[:, :8] = np.arange(n, dtype=np.uint64).view(np.uint8).reshape(n, 8)
                dst = np.zeros((n, bs), dtype=np.uint8)
                blocks = [src[i] for i in range(n)]
                outs = [dst[i] for i in range(n)]
                ns = {"model_id": "bench-data", "block_tokens": 16, "block_bytes": bs}
                clients = {
                    "shm": await AsyncClient.connect(kvk.url, ns, transport="shm", checksum="none",
                                                     timeout=120),
                    "shm_crc32": await AsyncClient.connect(kvk.url, ns, transport="shm",
                                                           checksum="crc32", timeout=120),
                    "stream": await AsyncClient.connect(kvk.url, ns, transport="stream",
                                                        checksum="none", timeout=120),
                }
                try:
                    if first:
                        # Touch every arena page once (the file is sparse).
                        log("data: writing the arena through once")
                        for _ in range(2):
                            await clients["shm"].save(keys.take(n), blocks)
                        first = False
                    save_chunk = min(WRITE_CHUNK_BYTES, bs)
                    load_chunk = min(STREAM_CHUNK_BYTES, bs)

                    saved: dict[str, list[bytes]] = {}
                    mvs = [memoryview(o) for o in outs]

                    async def kv_save(kind: str) -> float:
                        ks = saved[kind] = keys.take(n)
                        t0 = time.perf_counter()
                        r = await clients[kind].save(ks, blocks)
                        t = time.perf_counter() - t0
                        if r.committed != n:
                            raise RuntimeError(f"{kind} save committed {r.committed} of {n}")
                        return t

                    async def kv_load(kind: str) -> float:
                        cl = clients[kind]
                        m = await cl.match(saved[kind], lease=True)
                        if m.matched != n or m.lease_id is None:
                            raise RuntimeError(f"{kind}: matched {m.matched} of {n} just saved")
                        dst[:, :8] = 0
                        t0 = time.perf_counter()
                        await cl.load_into(m.lease_id, outs)
                        t = time.perf_counter() - t0
                        await cl.release(m.lease_id)
                        if not np.array_equal(dst[:, :8], src[:, :8]):
                            raise RuntimeError(f"{kind}: loaded bytes differ from the saved ones")
                        return t

                    def memcpy() -> float:
                        t0 = time.perf_counter()
                        for a, b in zip(outs, blocks):
                            np.copyto(a, b)
                        return time.perf_counter() - t0

                    def chunks() -> Any:
                        for v in blocks:
                            mv = memoryview(v)
                            for off in range(0, bs, save_chunk):
                                yield bytes(mv[off:off + save_chunk])

                    async def raw_save() -> float:
                        t0 = time.perf_counter()
                        got = U64.unpack(await sink(chunks(), timeout=120))[0]
                        t = time.perf_counter() - t0
                        if got != n * bs:
                            raise RuntimeError(f"raw sink got {got} bytes of {n * bs}")
                        return t

                    async def raw_load() -> float:
                        t0 = time.perf_counter()
                        i = off = 0
                        async for chunk in source(SOURCE_REQ.pack(n * bs, bs, load_chunk),
                                                  timeout=120):
                            ln = len(chunk)
                            mvs[i][off:off + ln] = chunk
                            off += ln
                            if off == bs:
                                i, off = i + 1, 0
                        t = time.perf_counter() - t0
                        if i != n:
                            raise RuntimeError(f"raw source sent {i} of {n} blocks")
                        return t

                    kinds: dict[str, tuple[Callable[[], Any], Callable[[], Any]]] = {
                        "memcpy": (lambda: _sync(memcpy), lambda: _sync(memcpy)),
                        "shm": (lambda: kv_save("shm"), lambda: kv_load("shm")),
                        "shm_crc32": (lambda: kv_save("shm_crc32"), lambda: kv_load("shm_crc32")),
                        "stream": (lambda: kv_save("stream"), lambda: kv_load("stream")),
                        "raw": (raw_save, raw_load),
                    }
                    times: dict[str, dict[str, list[float]]] = {
                        k: {"save": [], "load": []} for k in kinds}
                    for rep in range(scale.reps + 1):   # rep 0 is the warm-up
                        order = list(kinds) if rep % 2 == 0 else list(reversed(kinds))
                        for k in order:
                            save, load = kinds[k]
                            ts = await save()
                            tl = await load()
                            if rep:
                                times[k]["save"].append(ts)
                                times[k]["load"].append(tl)
                finally:
                    for cl in clients.values():
                        await cl.close()
                results += _results(times, n, bs, label, save_chunk, load_chunk, scale)
                del src, dst, blocks, outs
        finally:
            await channel.close()
    return results


async def _sync(fn: Callable[[], float]) -> float:
    return fn()


def _results(times: dict[str, dict[str, list[float]]], n: int, bs: int, label: str,
             save_chunk: int, load_chunk: int, scale: Scale) -> list[Result]:
    nbytes = n * bs
    g = {k: {d: _gbps(nbytes, median(v)) for d, v in dirs.items()} for k, dirs in times.items()}
    base = {"block_bytes": bs, "blocks": n, "bytes": nbytes, "reps": scale.reps,
            "page_bytes": PAGE_BYTES}
    out = []
    for d in ("save", "load"):
        out.append(Result(
            name=f"data.shm.{d}_gbps.{label}", value=g["shm"][d], unit="GB/s",
            baseline_name="np.copyto of the same blocks", baseline_value=g["memcpy"][d],
            better="higher", target=">= 0.6",
            params={**base, "transport": "shm", "checksum": "none"},
            note=("AsyncClient.save (ReserveSave + copy into the arena + CommitSave)" if d == "save"
                  else "AsyncClient.load_into (Load + copy out of the arena); match/release untimed")))
    for d in ("save", "load"):
        out.append(Result(
            name=f"data.stream.{d}_gbps.{label}", value=g["stream"][d], unit="GB/s",
            baseline_name=(f"raw grpc.aio client stream, {_size_label(save_chunk)} chunks" if d == "save"
                           else f"raw grpc.aio server stream, {_size_label(load_chunk)} chunks"),
            baseline_value=g["raw"][d], better="higher", target=">= 0.8",
            params={**base, "transport": "stream", "checksum": "none",
                    "chunk_bytes": save_chunk if d == "save" else load_chunk},
            note=("ReserveSave + WriteBlocks + CommitSave" if d == "save"
                  else "LoadStream into preallocated buffers; match/release untimed")))
    for d in ("save", "load"):
        out.append(Result(
            name=f"data.shm_crc32.{d}_gbps.{label}", value=g["shm_crc32"][d], unit="GB/s",
            baseline_name="np.copyto of the same blocks", baseline_value=g["memcpy"][d],
            better="higher", params={**base, "transport": "shm", "checksum": "crc32"},
            note="as data.shm, with CRC32 computed at save / verified at load"))
    return out


def run(quick: bool = False, *, scale: Scale | None = None,
        log: Callable[[str], None] = lambda s: None) -> list[Result]:
    from .serve_helper import run_async

    return run_async(_run(scale or Scale.for_mode(quick), log))
