"""Shutdown steps that all run: one that fails does not leave the others undone.

Why. Daemon.stop releases in order: the listeners, the tiers' write-back, the
arena, the socket files. When a step raised, stop() used to end there: a
daemon stopped before it had finished starting (grpc's server.stop raises
then) left its arena in /dev/shm and its peer and lane sockets behind.
Each failure is logged; the first is raised once every step has run, so
that a failed write-back still fails the run (exit status 1).
"""
from __future__ import annotations

import inspect
import logging
from typing import Any, Callable, Iterable, Optional

log = logging.getLogger("kvkeeper")


async def run_all(steps: Iterable[tuple[str, Callable[[], Any]]]) -> None:
    """Call each (what, step) in order, awaiting what a step returns if awaitable."""
    first: Optional[BaseException] = None
    for what, step in steps:
        try:
            result = step()
            if inspect.isawaitable(result):
                await result
        except BaseException as e:   # noqa: BLE001 - the next steps run whatever this was
            log.error("shutdown: %s failed: %s", what, e, exc_info=True,
                      extra={"event": "shutdown_step_failed", "step": what})
            if first is None:
                first = e
    if first is not None:
        raise first
