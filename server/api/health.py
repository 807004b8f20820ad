"""grpc.health.v1 as grpc's own asyncio servicer (grpc_health.v1.health.aio) serves it,
except that a Watch call ends when the daemon stops.

Why. grpc's Watch never returns by itself: at shutdown it writes NOT_SERVING
and waits for the next change, which never comes, so one open Watch (a load
balancer's, grpc's client-side health checking) held every stop for the
whole grace period. Here, once `enter_graceful_shutdown()` has run, a Watch
writes NOT_SERVING and ends UNAVAILABLE, as WatchSession and WatchEvents do
(api/watch.py, api/residency.py): the client knows to look elsewhere.
"""
from __future__ import annotations

import asyncio
from typing import Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

SERVING = health_pb2.HealthCheckResponse.SERVING
NOT_SERVING = health_pb2.HealthCheckResponse.NOT_SERVING
SERVICE_UNKNOWN = health_pb2.HealthCheckResponse.SERVICE_UNKNOWN


class Health(health_pb2_grpc.HealthServicer):
    """Check, Watch, and the statuses the daemon sets ("" is the whole server)."""

    def __init__(self) -> None:
        self._status: dict[str, int] = {"": SERVING}
        # One condition for every service: a change wakes all watchers, each
        # writes only if its own service changed (a handful of watchers at most).
        self._changed = asyncio.Condition()
        self.stopping = False

    async def Check(self, request: health_pb2.HealthCheckRequest, context: Any) -> Any:
        status = self._status.get(request.service)
        if status is None:
            await context.abort(grpc.StatusCode.NOT_FOUND)
        return health_pb2.HealthCheckResponse(status=status)

    async def Watch(self, request: health_pb2.HealthCheckRequest, context: Any) -> None:
        last = None
        # Held while writing, as grpc's: a change made meanwhile waits, so none is missed.
        async with self._changed:
            while True:
                status = self._status.get(request.service, SERVICE_UNKNOWN)
                if status != last:
                    await context.write(health_pb2.HealthCheckResponse(status=status))
                    last = status
                if self.stopping:
                    await context.abort(grpc.StatusCode.UNAVAILABLE,
                                        "the daemon is shutting down")
                await self._changed.wait()

    async def set(self, service: str, status: int) -> None:
        """Set a service's status; ignored once shutdown began (it stays NOT_SERVING)."""
        if self.stopping:
            return
        async with self._changed:
            self._status[service] = status
            self._changed.notify_all()

    async def enter_graceful_shutdown(self) -> None:
        """Every service NOT_SERVING for good; every Watch writes it and ends."""
        if self.stopping:
            return
        async with self._changed:
            self.stopping = True
            for service in self._status:
                self._status[service] = NOT_SERVING
            self._changed.notify_all()
