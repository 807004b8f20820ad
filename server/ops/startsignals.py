"""Signals that come while the daemon is being built, before the event loop's handlers exist.

Why. Building a daemon (app.create_server: the arena's prefault, ~0.4 s per
GiB; the disk tier's recovery; binding) runs in the event loop's thread
without yielding, so handlers added with loop.add_signal_handler would not
run before it ends, and without any handler SIGTERM and SIGHUP kill the
process by default: no log line, and the arena file (hundreds of MiB of
/dev/shm) stays behind. SIGINT would reach asyncio's runner, which cancels
start-up midway and leaves whatever it had made.

So from before the first file is touched until the loop's handlers are in,
plain signal handlers only note what came:

* SIGTERM/SIGINT: a stop. A step that can stop midway (the prefault, through
  its progress callback: `check`) raises StartupInterrupted, and the arena
  removes its file; any other step finishes first. Either way the daemon
  then stops without serving, cleanly (exit status 0).
* SIGHUP: a reload, run once the daemon serves (the file may have been
  edited while it started).
"""
from __future__ import annotations

import signal
from types import FrameType
from typing import Any, Callable, Optional

STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)
RELOAD_SIGNAL = signal.SIGHUP


class StartupInterrupted(Exception):
    """SIGTERM or SIGINT came while the daemon was being built: stop, don't serve."""

    def __init__(self, signum: int) -> None:
        super().__init__(f"{signal.Signals(signum).name} during start-up")
        self.signum = signum


class StartupSignals:
    """Notes SIGTERM, SIGINT and SIGHUP from `install()` until `restore()` or
    until the event loop's own handlers replace these."""

    def __init__(self) -> None:
        self.stop_signal: Optional[int] = None      # the first SIGTERM/SIGINT noted
        self.reload = False                         # a SIGHUP was noted
        self._saved: dict[int, Any] = {}

    def install(self) -> "StartupSignals":
        for sig in (*STOP_SIGNALS, RELOAD_SIGNAL):
            self._saved[sig] = signal.signal(sig, self._note)
        return self

    def restore(self) -> None:
        """The handlers found at install() (start-up failed: nobody takes over)."""
        for sig, handler in self._saved.items():
            signal.signal(sig, handler)
        self._saved.clear()

    def _note(self, signum: int, frame: Optional[FrameType]) -> None:
        # Nothing but a note: this runs between two bytecodes of whatever start-up does.
        if signum == RELOAD_SIGNAL:
            self.reload = True
        elif self.stop_signal is None:
            self.stop_signal = signum

    def check(self) -> None:
        """StartupInterrupted once a stop was noted (for steps that may end midway)."""
        if self.stop_signal is not None:
            raise StartupInterrupted(self.stop_signal)


def interruptible(progress: Callable[[int], None],
                  check: Optional[Callable[[], None]]) -> Callable[[int], None]:
    """`progress` that first calls `check`, whose exception ends the step."""
    if check is None:
        return progress

    def checked(done: int) -> None:
        check()
        progress(done)
    return checked
