"""Which CPUs the connector's own threads run on.

vLLM's CPU worker pins its process to the cores of its OpenMP threads (with
VLLM_CPU_NUM_OF_RESERVED_CPU cores left out for the rest of the engine), and
a thread inherits the affinity of the thread that creates it. Left alone,
the connector's I/O threads (gRPC client loop, loads, checksum checks,
saves, releases) would share the forward pass's core instead of running
beside it on a reserved one. `use_spare_cpus()` moves the calling thread to
the CPUs its parent process may use that this process's main thread does
not compute on; it changes nothing where there are none (a GPU worker, or a
machine with no reserved core).
"""
from __future__ import annotations

import logging
import os
import threading
from typing import FrozenSet

__all__ = ["spare_cpus", "use_spare_cpus"]

log = logging.getLogger("kvkeeper.connector")


def _affinity(pid: int) -> FrozenSet[int]:
    try:
        return frozenset(os.sched_getaffinity(pid))
    except (AttributeError, OSError):
        return frozenset()


def spare_cpus() -> FrozenSet[int]:
    """CPUs of the parent process (the engine core, which vLLM does not pin)
    minus those of this process's main thread (read each time: vLLM pins
    the main thread while the worker starts)."""
    main = _affinity(threading.main_thread().native_id or 0)
    wider = _affinity(os.getppid())
    return frozenset(wider - main) if main and wider else frozenset()


def use_spare_cpus() -> bool:
    """Move the calling thread to spare_cpus(); whether it moved. Call it at
    the start of a connector thread, before it creates others."""
    cpus = spare_cpus()
    if not cpus:
        return False
    try:
        os.sched_setaffinity(0, cpus)   # 0: the calling thread on Linux
    except OSError as e:
        log.debug("kvkeeper: cannot move thread %s to CPUs %s: %s",
                  threading.current_thread().name, sorted(cpus), e)
        return False
    return True
