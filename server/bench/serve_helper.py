"""Servers the benchmarks run in a separate process, so that the server and
the load generator do not share an event loop or a GIL.

    python -m kvkeeper.server.bench.serve_helper kvkeeper --socket PATH
        --capacity BYTES --page-bytes BYTES --name SHM_NAME
    python -m kvkeeper.server.bench.serve_helper raw --socket PATH

`kvkeeper` runs the real daemon (`app.create_server`, as `kvkeeper serve`
does) on the unix socket (and, with --tcp, on TCP as well). `raw` is the baseline: a bare
grpc.aio server with one generic handler (no protobuf, no servicer class),
service `kvkbench.Raw`:

    Echo    unary          bytes -> 8 bytes (the request length, u64 LE)
    Sink    client stream  chunks -> 8 bytes (total length); each chunk is
                           copied into a preallocated buffer, as storing it requires
    Source  server stream  request "<QQQ" (total, block_bytes, chunk_bytes) ->
                           total/block_bytes blocks, each as chunks of at most
                           chunk_bytes, each chunk one copy out of a
                           preallocated buffer (as serving stored bytes requires)

The buffers are --buffer-bytes long (the bytes one measurement moves), so
like the daemon's arena they do not fit in a CPU cache.

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
    """Preallocated buffers, every page written at start-up: a fresh large
    allocation is untouched zero pages, which would make the first copies pay
    for page faults and reads of it come from one cached zero page."""

    def __init__(self, nbytes: int) -> None:
        import numpy as np

        self.sink = memoryview(bytearray(nbytes))
        self.source = memoryview(bytearray(nbytes))
        for mv in (self.sink, self.source):
            np.frombuffer(mv, dtype=np.uint8)[:] = 0x5A


def raw_handler(bufs: _Buffers) -> grpc.GenericRpcHandler:
    async def echo(request: bytes, context: Any) -> bytes:
        return U64.pack(len(request))

    async def sink(request_iterator: AsyncIterator[bytes], context: Any) -> bytes:
        mv = bufs.sink
        size = len(mv)
        total = pos = 0
        async for chunk in request_iterator:
            n = len(chunk)
            if pos + n > size:
                pos = 0
            mv[pos:pos + n] = chunk
            pos += n
            total += n
        return U64.pack(total)

    async def source(request: bytes, context: Any) -> AsyncIterator[bytes]:
        total, block, chunk = SOURCE_REQ.unpack(request)
        mv = bufs.source
        size = len(mv) - len(mv) % block
        pos = 0
        for _ in range(total // block):
            if pos + block > size:
                pos = 0
            for off in range(0, block, chunk):
                yield bytes(mv[pos + off:pos + min(off + chunk, block)])
            pos += block

    return grpc.method_handlers_generic_handler(RAW_SERVICE, {
        "Echo": grpc.unary_unary_rpc_method_handler(echo),
        "Sink": grpc.stream_unary_rpc_method_handler(sink),
        "Source": grpc.unary_stream_rpc_method_handler(source),
    })


def _watch_stdin(loop: asyncio.AbstractEventLoop, stop: asyncio.Event) -> None:
    """Set `stop` when stdin reaches EOF (the parent closed the pipe or died)."""
    fd = sys.stdin.fileno()

    def readable() -> None:
        try:
            data = os.read(fd, 4096)
        except BlockingIOError:
            return
        except OSError:
            data = b""
        if not data:
            loop.remove_reader(fd)
            stop.set()

    try:
        loop.add_reader(fd, readable)
    except (OSError, ValueError, NotImplementedError):
        pass  # stdin is not a pipe (run by hand): SIGTERM/SIGINT only


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


async def serve_raw(socket_path: str, buffer_bytes: int) -> None:
    stop = _stop_event()
    server = grpc.aio.server(options=RAW_OPTIONS)
    server.add_generic_rpc_handlers((raw_handler(_Buffers(buffer_bytes)),))
    if os.path.lexists(socket_path):
        os.unlink(socket_path)
    server.add_insecure_port(f"unix:{socket_path}")
    await server.start()
    _ready()
    await stop.wait()
    await server.stop(0)


async def serve_kvkeeper(socket_path: str, capacity: int, page_bytes: int, name: str,
                         tcp: str = "", policy: str = "") -> None:
    from kvkeeper.server.app import create_server
    from kvkeeper.server.config import load_config

    config = load_config(None, env={}, overrides={
        "listen.socket": socket_path, "listen.tcp": tcp, "metrics.address": "",
        "host_tier.capacity_bytes": capacity, "host_tier.page_bytes": page_bytes,
        "host_tier.name": name, "server.grace_seconds": 1.0, "server.log_level": "warning",
        **({"ledger.eviction_policy": policy} if policy else {})})
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
    raw.add_argument("--buffer-bytes", type=int, default=64 << 20,
                     help="size of the Sink and Source buffers (the bytes a run moves)")
    kvk = sub.add_parser("kvkeeper")
    kvk.add_argument("--socket", required=True)
    kvk.add_argument("--capacity", type=int, required=True)
    kvk.add_argument("--page-bytes", type=int, required=True)
    kvk.add_argument("--name", required=True)
    kvk.add_argument("--tcp", default="", help="also listen on this host:port")
    kvk.add_argument("--eviction-policy", default="", help="the ledger's (default: the daemon's)")
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    if args.kind == "raw":
        coro = serve_raw(args.socket, args.buffer_bytes)
    else:
        coro = serve_kvkeeper(args.socket, args.capacity, args.page_bytes, args.name, args.tcp,
                              args.eviction_policy)
    run_async(coro)
    return 0


def run_async(coro: Any) -> Any:
    """uvloop.run when uvloop is installed, asyncio.run otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run(coro)
    return uvloop.run(coro)


if __name__ == "__main__":
    sys.exit(main())
