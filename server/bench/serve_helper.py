"""Servers the benchmarks run in a separate process, so that the server and
the load generator do not share an event loop or a GIL.

    python -m kvkeeper.server.bench.serve_helper kvkeeper --socket PATH
        --capacity BYTES --page-bytes BYTES --name SHM_NAME
    python -m kvkeeper.server.bench.serve_helper raw --socket PATH

`kvkeeper` runs the real daemon (`app.create_server`, as `kvkeeper serve`
does) with only the unix socket enabled. `raw` is the baseline: a bare
grpc.aio server with one generic handler (no protobuf, no servicer class),
service `kvkbench.Raw`:

    Echo    unary          bytes -> 8 bytes (the request length, u64 LE)
    Sink    client stream  chunks -> 8 bytes (total length); each chunk is
                           copied into a preallocated buffer, as storing it requires
    Source  server stream  request "<QQQ" (total, block_bytes, chunk_bytes) ->
                           total/block_bytes blocks, each as chunks of at most
                           chunk_bytes, each chunk one copy out of a
                           preallocated buffer of `total` bytes (as serving stored bytes requires)

Both use uvloop when installed (as the daemon's `run` does) and the daemon's
message size limits. Each prints "READY" on stdout once it accepts calls and
stops on SIGTERM/SIGINT or when its stdin closes (the parent went away).
"""
from __future__ import annotations

import argparse
import asyncio
import logging
import os
import signal
import struct
import sys
import threading
from typing import Any, AsyncIterator, Optional

import grpc

RAW_SERVICE = "kvkbench.Raw"
MAX_MESSAGE_BYTES = 64 << 20
SOURCE_REQ = struct.Struct("<QQQ")
U64 = struct.Struct("<Q")
RAW_OPTIONS = [("grpc.max_send_message_length", MAX_MESSAGE_BYTES),
               ("grpc.max_receive_message_length", MAX_MESSAGE_BYTES),
               ("grpc.so_reuseport", 0)]


class _Buffers:
    """Preallocated, pre-touched buffers, grown on demand."""

    def __init__(self) -> None:
        self.sink = bytearray()
        self.source = bytearray()

    @staticmethod
    def _grow(buf: bytearray, n: int) -> bytearray:
        if len(buf) < n:
            buf = bytearray(n)       # zero-filled: every page touched
        return buf


def raw_handler(bufs: _Buffers) -> grpc.GenericRpcHandler:
    async def echo(request: bytes, context: Any) -> bytes:
        return U64.pack(len(request))

    async def sink(request_iterator: AsyncIterator[bytes], context: Any) -> bytes:
        total = 0
        mv: Optional[memoryview] = None
        async for chunk in request_iterator:
            n = len(chunk)
            if mv is None or len(mv) < n:
                bufs.sink = bufs._grow(bufs.sink, max(n, 64 << 20))
                mv = memoryview(bufs.sink)
            pos = total % (len(mv) - n + 1)
            mv[pos:pos + n] = chunk
            total += n
        return U64.pack(total)

    async def source(request: bytes, context: Any) -> AsyncIterator[bytes]:
        total, block, chunk = SOURCE_REQ.unpack(request)
        bufs.source = bufs._grow(bufs.source, total)
        mv = memoryview(bufs.source)
        for start in range(0, total - block + 1, block):
            for off in range(0, block, chunk):
                yield bytes(mv[start + off:start + min(off + chunk, block)])

    return grpc.method_handlers_generic_handler(RAW_SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Sink": grpc.stream_unary_rpc_method_handler(sink),
        "Source": grpc.unary_stream_rpc_method_handler(source),
    })


def _watch_stdin(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    def wait() -> None:
        try:
            while sys.stdin.buffer.read(4096):
                pass
        except (OSError, ValueError):
            pass
        loop.call_soon_threadsafe(stop.set)

    threading.Thread(target=wait, name="stdin-watch", daemon=True).start()


def _stop_event() -> asyncio.Event:
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop.set)
    _watch_stdin(loop, stop)
    return stop


def _ready() -> None:
    sys.stdout.write("READY\n")
    sys.stdout.flush()


async def serve_raw(socket_path: str) -> None:
    stop = _stop_event()
    server = grpc.aio.server(options=RAW_OPTIONS)
    server.add_generic_rpc_handlers((raw_handler(_Buffers()),))
    if os.path.lexists(socket_path):
        os.unlink(socket_path)
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    _ready()
    await stop.wait()
    await server.stop(0)


async def serve_kvkeeper(socket_path: str, capacity: int, page_bytes: int, name: str) -> None:
    from kvkeeper.server.app import create_server
    from kvkeeper.server.config import load_config

    config = load_config(None, env={}, overrides={
        "listen.socket": socket_path, "listen.tcp": "", "metrics.address": "",
        "host_tier.capacity_bytes": capacity, "host_tier.page_bytes": page_bytes,
        "host_tier.name": name, "server.grace_seconds": 1.0, "server.log_level": "warning"})
    stop = _stop_event()
    daemon, _ = create_server(config)
    await daemon.start()
    _ready()
    try:
        await stop.wait()
    finally:
        await daemon.stop(0)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(prog="python -m kvkeeper.server.bench.serve_helper")
    sub = p.add_subparsers(dest="kind", required=True)
    raw = sub.add_parser("raw")
    raw.add_argument("--socket", required=True)
    kvk = sub.add_parser("kvkeeper")
    kvk.add_argument("--socket", required=True)
    kvk.add_argument("--capacity", type=int, required=True)
    kvk.add_argument("--page-bytes", type=int, required=True)
    kvk.add_argument("--name", required=True)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.kind == "raw":
        coro = serve_raw(args.socket)
    else:
        coro = serve_kvkeeper(args.socket, args.capacity, args.page_bytes, args.name)
    try:
        import uvloop
        uvloop.run(coro)
    except ImportError:
        asyncio.run(coro)
    return 0


if __name__ == "__main__":
    sys.exit(main())
