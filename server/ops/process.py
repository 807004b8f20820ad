"""`kvkeeper serve` as a process: the daemon (app.py) run until a signal, SIGHUP
reloads, and the exit status.

Signals. From before the first file is touched, SIGTERM/SIGINT stop and
SIGHUP reloads, whenever they come: during start-up they are noted
(ops/startsignals.py), and a stop noted then ends start-up without
serving, cleanly; once the daemon is built the event loop's handlers take
over. Exit status: 0 after a clean stop (a signal during start-up
included), 2 for a configuration problem found at start-up (the systemd
unit does not restart on it), 1 for any other failure.
"""
from __future__ import annotations

import asyncio
import logging
import signal
from typing import Any, Callable, Optional

from ..app import LINGER_SECONDS, Daemon, create_server
from ..config import Config, ConfigError
from . import logsetup
from .startsignals import RELOAD_SIGNAL, STOP_SIGNALS, StartupInterrupted, StartupSignals

log = logging.getLogger("kvkeeper")


def reload_config(daemon: Daemon, loader: Callable[[], Config]) -> None:
    """SIGHUP: read the configuration again and apply what may change. Whatever
    fails is logged with event=reload_refused, and the running config stays."""
    log.info("SIGHUP: re-reading the configuration", extra={"event": "reload_start"})
    try:
        new = loader()
    except Exception as e:  # noqa: BLE001 - not only ConfigError: a reload must not stop the daemon
        key = e.key if isinstance(e, ConfigError) else None
        log.error("reload: the configuration was not re-read: %s", e,
                  exc_info=not isinstance(e, ConfigError),
                  extra={"event": "reload_refused", "key": key or ""})
        return
    try:
        daemon.reload(new)
    except Exception as e:  # noqa: BLE001 - as above
        log.error("reload failed; the running configuration is unchanged: %s", e, exc_info=True,
                  extra={"event": "reload_refused", "key": ""})


async def serve(config: Config, loader: Optional[Callable[[], Config]] = None,
                signals: Optional[StartupSignals] = None) -> None:
    """Serve until SIGTERM/SIGINT. SIGHUP calls `loader` (re-reads the file, the
    environment and the flags) and applies the result; without one SIGHUP is ignored.
    `signals`: the start-up notes, when the caller installed them earlier (run())."""
    signals = signals or StartupSignals().install()
    try:
        daemon, _ = create_server(config, interrupt=signals.check)
    except StartupInterrupted as e:
        signals.restore()
        log.info("%s: stopped before serving", e)   # the arena removed its file
        return
    except BaseException:
        signals.restore()
        raise
    loop = asyncio.get_running_loop()
    stop = asyncio.Event()

    def hup() -> None:
        # Once for a SIGHUP noted during start-up: uvloop may deliver that one too.
        signals.reload = False
        if loader is None:
            log.warning("SIGHUP ignored: this daemon has no configuration to re-read")
        else:
            reload_config(daemon, loader)

    for sig in STOP_SIGNALS:
        loop.add_signal_handler(sig, stop.set)
    loop.add_signal_handler(RELOAD_SIGNAL, hup)
    # The loop's handlers are in: from here a signal reaches them, not the notes.
    try:
        if signals.stop_signal is not None:
            log.info("%s during start-up: stopping before serving",
                     signal.Signals(signals.stop_signal).name)
            return
        await daemon.start()
        if signals.reload:
            hup()   # the file may have been edited while the daemon started
        await stop.wait()
        log.info("signal received: draining (grace %.1fs)", daemon.config.server.grace_seconds)
    finally:
        await daemon.stop(linger=LINGER_SECONDS)


def _runner() -> Any:
    """uvloop's runner when installed (faster RPC turnaround), asyncio's otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.run
    return uvloop.run


def run(config: Config, loader: Optional[Callable[[], Config]] = None) -> int:
    """Serve; 0 after a clean stop, 1 on a runtime failure, 2 on a configuration
    problem found at start-up (credentials, TLS files, the socket's group, paths
    and addresses the system refuses: ops/startfaults.py)."""
    logsetup.configure(config.server.log_level, config.server.log_format)
    # Before the runner: asyncio's would otherwise take SIGINT and cancel start-up midway.
    signals = StartupSignals().install()
    try:
        _runner()(serve(config, loader, signals))
    except ConfigError as exc:
        log.error("config error: %s", exc, extra={"event": "config_error", "key": exc.key or ""})
        return 2
    except RuntimeError as exc:
        log.error("%s", exc)
        return 1
    return 0
