"""Log lines that a client can cause, fewer as they repeat.

A client stuck on a bad token, a fuzzer, or someone guessing session ids must
not flood the log: each kind of event is logged the first LOUD times, then at
every power of two, each line saying how many there were so far. Counts, not
time, so the pattern is the same under any load and tests need no clock.
"""
from __future__ import annotations

import logging
from typing import Any

LOUD = 10


class RepeatLog:
    def __init__(self, logger: logging.Logger, event: str, level: int = logging.WARNING) -> None:
        self.logger = logger
        self.event = event
        self.level = level
        self.count = 0

    def log(self, msg: str, *args: Any, **extra: Any) -> bool:
        """Log `msg % args` (plus the running count) if this occurrence is due; True if logged."""
        self.count += 1
        n = self.count
        if n > LOUD and n & (n - 1):
            return False
        self.logger.log(self.level, msg + " (%d so far)", *args, n,
                        extra={"event": self.event, **extra})
        return True
