"""The worker's I/O thread: its RPCs and, with a spare core, its copies and checks.

One thread, started on first use on the cores vLLM's CPU backend leaves to
the rest of the engine (cpus.py); threads it starts (the gRPC client's
loop) inherit its CPUs, which is why the first connection is made from it.
"""
from __future__ import annotations

from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any, Callable, Optional, TypeVar

from .config import ConnectorConfig
from .cpus import use_spare_cpus

__all__ = ["IoThread"]

T = TypeVar("T")


class IoThread:
    def __init__(self, cfg: Optional[ConnectorConfig]) -> None:
        self._pool: Optional[ThreadPoolExecutor] = None
        # The longest a job may take: its RPCs with every retry, and a second.
        self.wait_s = (cfg.io_timeout_s * (cfg.max_retries + 1) + 1.0) if cfg is not None else 10.0

    def submit(self, fn: Callable[..., T], *args: Any) -> "Future[T]":
        if self._pool is None:
            self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvkeeper-io",
                                            initializer=use_spare_cpus)
        return self._pool.submit(fn, *args)

    def shutdown(self) -> None:
        if self._pool is not None:
            self._pool.shutdown(wait=False, cancel_futures=True)
