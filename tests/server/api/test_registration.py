"""How the daemon's services reach grpc (decoding.add_guarded, GenericOnly):
as generic handlers only, never as grpc.aio registered methods, which cost
every call a wait over one pending task per registered method. Health and
reflection still answer, for every service the daemon serves."""
from __future__ import annotations

from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection_pb2, reflection_pb2_grpc

from kvkeeper.server.api.decoding import GenericOnly, add_guarded
from kvkeeper.server.app import create_server
from kvkeeper.v1 import kvkeeper_pb2_grpc


class Recorder:
    def __init__(self) -> None:
        self.generic: list[Any] = []
        self.registered: list[str] = []

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        self.generic.extend(handlers)

    def add_registered_method_handlers(self, service: str, handlers: Any) -> None:
        self.registered.append(service)


def test_guarded_and_grpc_own_services_are_added_as_generic_handlers_only():
    rec = Recorder()
    add_guarded(kvkeeper_pb2_grpc.add_KVKeeperServicer_to_server,
                kvkeeper_pb2_grpc.KVKeeperServicer(), rec)
    health_pb2_grpc.add_HealthServicer_to_server(health_pb2_grpc.HealthServicer(),
                                                 GenericOnly(rec))
    assert rec.registered == []
    names = {h.service_name() for h in rec.generic}
    assert names == {"kvkeeper.v1.KVKeeper", "grpc.health.v1.Health"}


async def test_the_daemon_registers_no_method_with_grpc(daemon_config, monkeypatch):
    """Every registration that reaches the grpc.aio server, counted."""
    seen: list[str] = []
    real = grpc.aio.server

    def server(*a: Any, **kw: Any) -> Any:
        s = real(*a, **kw)
        orig = s.add_registered_method_handlers
        s.add_registered_method_handlers = lambda name, h: (seen.append(name), orig(name, h))
        return s

    monkeypatch.setattr(grpc.aio, "server", server)
    d, _ = create_server(daemon_config())
    try:
        assert seen == []
    finally:
        await d.stop(0)


async def test_health_and_reflection_answer_for_every_service(daemon):
    async with grpc.aio.insecure_channel(f"unix:{daemon.socket_path}") as ch:
        h = await health_pb2_grpc.HealthStub(ch).Check(
            health_pb2.HealthCheckRequest(service="kvkeeper.v1.KVKeeper"))
        assert h.status == health_pb2.HealthCheckResponse.SERVING
        call = reflection_pb2_grpc.ServerReflectionStub(ch).ServerReflectionInfo(
            iter([reflection_pb2.ServerReflectionRequest(list_services="")]))
        listed = [s.name async for r in call for s in r.list_services_response.service]
    assert {"kvkeeper.v1.KVKeeper", "grpc.health.v1.Health",
            "grpc.reflection.v1alpha.ServerReflection"} <= set(listed)
