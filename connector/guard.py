"""Nothing the connector does can take vLLM down: every hook is guarded.

A hook that raises is logged (at most every 30 s per hook, with its
traceback) and answered by its fallback instead: "no hit", "no save",
"these blocks failed to load, recompute them". A fallback that raises too
is logged and answers None.
"""
from __future__ import annotations

import functools
import logging
import time
from typing import Any, Callable, Dict, Tuple

from .metadata import KVKeeperConnectorMetadata

__all__ = ["FailureLog", "guarded", "answer_none", "answer_miss", "answer_not_delayed",
           "answer_empty_meta", "answer_all_loads_failed"]

log = logging.getLogger("kvkeeper.connector")

LOG_EVERY_S = 30.0


class FailureLog:
    """Hook failures, logged at most once per LOG_EVERY_S per hook."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._last: Dict[str, float] = {}

    def failed(self, hook: str, exc: BaseException) -> None:
        now = self._clock()
        if now - self._last.get(hook, -1e9) >= LOG_EVERY_S:
            self._last[hook] = now
            log.error("kvkeeper: %s failed; treated as a miss / no save: %s", hook, exc,
                      exc_info=True)


def guarded(fallback: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Run the hook; on any exception log it in self.hook_failures (a
    FailureLog) and return fallback(self, *args)."""
    def deco(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def wrapper(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - the point of this wrapper
                self.hook_failures.failed(fn.__name__, e)
                try:
                    return fallback(self, *args, **kwargs)
                except Exception as e2:  # noqa: BLE001
                    self.hook_failures.failed(fn.__name__ + "/fallback", e2)
                    return None
        return wrapper
    return deco


def answer_none(self: Any, *a: Any, **k: Any) -> None:
    return None


def answer_miss(self: Any, *a: Any, **k: Any) -> Tuple[int, bool]:
    return 0, False


def answer_not_delayed(self: Any, *a: Any, **k: Any) -> Tuple[bool, None]:
    return False, None


def answer_empty_meta(self: Any, *a: Any, **k: Any) -> KVKeeperConnectorMetadata:
    return KVKeeperConnectorMetadata()


def answer_all_loads_failed(self: Any, *a: Any, **k: Any) -> set:
    """get_block_ids_with_load_errors' fallback: every block this step's
    loads target counts as failed, so vLLM recomputes them rather than use
    blocks whose load nobody vouched for (answering none would be the unsafe
    direction)."""
    try:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
    except Exception:  # noqa: BLE001 - no bound metadata: this step loaded nothing
        return set()
    return {b for spec in getattr(meta, "loads", None) or () for b in spec.block_ids}
