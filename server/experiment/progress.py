"""A one-line progress bar on stderr: redrawn in place on a terminal, one line
per finished run otherwise (logs stay readable)."""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO


class Progress:
    def __init__(self, label: str, total: int, stream: Optional[TextIO] = None, width: int = 24,
                 enabled: bool = True):
        self.enabled = enabled
        self.label, self.total, self.width = label, max(1, total), width
        self.stream = stream or sys.stderr
        self.done = self.failed = 0
        self.t0 = time.monotonic()
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())

    def line(self) -> str:
        filled = self.width * self.done // self.total
        bar = "#" * filled + "-" * (self.width - filled)
        return (f"{self.label:<22} [{bar}] {self.done}/{self.total}"
                f"  failed {self.failed}  {time.monotonic() - self.t0:5.1f}s")

    def step(self, ok: bool) -> None:
        self.done += 1
        self.failed += 0 if ok else 1
        if not self.enabled:
            return
        if self.tty:
            end = "\n" if self.done >= self.total else ""
            print("\r" + self.line(), end=end, file=self.stream, flush=True)
        elif self.done >= self.total:
            print(self.line(), file=self.stream, flush=True)
