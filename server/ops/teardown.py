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
import os
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
            _failed(what, e)
            first = first or e
    if first is not None:
        raise first


def run_all_now(steps: Iterable[tuple[str, Callable[[], Any]]]) -> None:
    """run_all of steps that are plain calls (Daemon.unbind: no event loop needed)."""
    first: Optional[BaseException] = None
    for what, step in steps:
        try:
            step()
        except BaseException as e:   # noqa: BLE001 - as run_all
            _failed(what, e)
            first = first or e
    if first is not None:
        raise first


def _failed(what: str, e: BaseException) -> None:
    log.error("shutdown: %s failed: %s", what, e, exc_info=True,
              extra={"event": "shutdown_step_failed", "step": what})


def unlink_present(path: Optional[str]) -> None:
    """Remove the file at `path` if there is one (a socket's: a step above)."""
    if path and os.path.lexists(path):
        os.unlink(path)
