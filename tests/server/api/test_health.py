"""kvkeeper.server.api.health: grpc.health.v1 as grpc's servicer answers it, except that
an open Watch ends (NOT_SERVING, then UNAVAILABLE) when the daemon stops, instead of
holding the shutdown for the whole grace period."""
from __future__ import annotations

import asyncio
import time
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

Status = health_pb2.HealthCheckResponse


async def _watch(stub: Any, service: str, seen: list) -> None:
    try:
        async for r in stub.Watch(health_pb2.HealthCheckRequest(service=service)):
            seen.append(Status.ServingStatus.Name(r.status))
    except grpc.aio.AioRpcError as e:
        seen.append(e.code().name)
    else:
        seen.append("OK")


async def test_a_health_watch_ends_at_shutdown_without_holding_the_grace(daemon_factory) -> None:
    d = await daemon_factory(**{"server.grace_seconds": 5.0})
    async with grpc.aio.insecure_channel(f"unix:{d.socket_path}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        whole: list[str] = []
        unknown: list[str] = []
        watches = [asyncio.ensure_future(_watch(stub, "", whole)),
                   asyncio.ensure_future(_watch(stub, "no.such.Service", unknown))]
        for _ in range(100):
            if whole and unknown:
                break
            await asyncio.sleep(0.02)
        assert whole == ["SERVING"] and unknown == ["SERVICE_UNKNOWN"]
        t0 = time.monotonic()
        await d.stop()
        took = time.monotonic() - t0
        await asyncio.wait_for(asyncio.gather(*watches), 5.0)
    assert took < 2.0, f"stop took {took:.2f}s: a health Watch held the grace period"
    assert whole == ["SERVING", "NOT_SERVING", "UNAVAILABLE"]
    assert unknown == ["SERVICE_UNKNOWN", "UNAVAILABLE"]


async def test_check_and_watch_answer_as_grpc_s_servicer(daemon) -> None:
    async with grpc.aio.insecure_channel(f"unix:{daemon.socket_path}") as ch:
        stub = health_pb2_grpc.HealthStub(ch)
        ok = await stub.Check(health_pb2.HealthCheckRequest(service="kvkeeper.v1.KVKeeper"))
        assert ok.status == Status.SERVING
        try:
            await stub.Check(health_pb2.HealthCheckRequest(service="no.such.Service"))
            raise AssertionError("an unknown service was answered")
        except grpc.aio.AioRpcError as e:
            assert e.code() == grpc.StatusCode.NOT_FOUND
        call = stub.Watch(health_pb2.HealthCheckRequest(service=""))
        first = await call.read()
        assert first.status == Status.SERVING
        await daemon.health.set("", Status.NOT_SERVING)
        assert (await call.read()).status == Status.NOT_SERVING
        call.cancel()
