"""kvkeeper.server.ops.startsignals: during start-up a signal is noted, never fatal;
a noted stop ends the steps that check for it."""
from __future__ import annotations

import os
import signal

import pytest

from kvkeeper.server.ops.startsignals import StartupInterrupted, StartupSignals, interruptible


def test_signals_are_noted_and_the_handlers_restored() -> None:
    before = {s: signal.getsignal(s) for s in (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)}
    notes = StartupSignals().install()
    try:
        notes.check()                                  # nothing came: no interruption
        os.kill(os.getpid(), signal.SIGHUP)
        assert notes.reload and notes.stop_signal is None
        notes.check()                                  # a reload does not interrupt
        os.kill(os.getpid(), signal.SIGTERM)
        os.kill(os.getpid(), signal.SIGINT)
        assert notes.stop_signal == signal.SIGTERM     # the first stop is the one told
        with pytest.raises(StartupInterrupted, match="SIGTERM during start-up") as info:
            notes.check()
        assert info.value.signum == signal.SIGTERM
    finally:
        notes.restore()
    assert {s: signal.getsignal(s) for s in before} == before


def test_interruptible_progress_checks_before_each_step() -> None:
    done: list[int] = []
    stop = [False]

    def check() -> None:
        if stop[0]:
            raise StartupInterrupted(signal.SIGTERM)

    progress = interruptible(done.append, check)
    progress(1)
    stop[0] = True
    with pytest.raises(StartupInterrupted):
        progress(2)
    assert done == [1]
    p = done.append
    assert interruptible(p, None) is p
