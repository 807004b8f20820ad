"""Where the recorded traffic goes: `[ledger] traffic_file`, appended to by a thread.

The recorder (traffic.py) is pure; this owns the file. It is opened when the
daemon is built, so a path that cannot be written fails the start naming the
key; lines are handed over on the reaper's tick and written by one thread
(started with the first lines), so a slow disk or an NFS mount never stalls
the event loop; close() writes what is still open when the daemon stops.
A reload (SIGHUP) may turn it on, off or to another file (reload_traffic):
turning recording on must not cost a restart, which would empty the cache
whose traffic it records.
"""
from __future__ import annotations

import logging
import queue
import threading
from dataclasses import replace
from typing import Any, Callable, Optional, TextIO

from ..config import ConfigError
from ..ids import SessionId
from .startfaults import PATH_ERRNOS, blame
from .traffic import NO_TRAFFIC, TrafficRecorder

log = logging.getLogger("kvkeeper.traffic")


class TrafficFile:
    def __init__(self, path: str, limit: int,
                 namespace_of: Callable[[SessionId], Optional[str]]) -> None:
        self.path = path
        self.recorder = TrafficRecorder(namespace_of, limit)
        # Append: a restart adds to what an earlier run recorded, as a log does.
        self._fh: Optional[TextIO] = open(path, "a", encoding="ascii")
        self._lines: "queue.SimpleQueue[Optional[list[str]]]" = queue.SimpleQueue()
        self._thread: Optional[threading.Thread] = None
        self._said_done = False

    def tick(self, now: float) -> None:
        """Hand the requests closed by now to the writer."""
        rec = self.recorder
        lines = rec.take(now)
        if lines:
            if self._thread is None:
                self._thread = threading.Thread(target=self._write, name="kvkeeper-traffic",
                                                daemon=True)
                self._thread.start()
            self._lines.put(lines)
        if rec.finished and not self._said_done:
            self._said_done = True
            log.info("traffic recording done: %d requests in %s", rec.written, self.path)

    def close(self) -> None:
        """Write every request still open, then close the file (the daemon stops)."""
        if self._fh is None:
            return
        lines = self.recorder.drain()
        if self._thread is not None:
            self._lines.put(lines)
            self._lines.put(None)
            self._thread.join()
        elif lines:
            self._put(self._fh, lines)
        self._fh.close()
        self._fh = None

    def _write(self) -> None:
        fh = self._fh
        assert fh is not None
        while True:
            lines = self._lines.get()
            if lines is None:
                return
            self._put(fh, lines)

    def _put(self, fh: TextIO, lines: list[str]) -> None:
        if not lines:
            return
        try:
            fh.write("\n".join(lines) + "\n")
            fh.flush()
        except OSError as e:   # a full disk loses lines, never the daemon
            log.warning("traffic file %s: %d requests not written: %s", self.path, len(lines), e)


class NoTrafficFile:
    """[ledger] traffic_file is "": nothing recorded, nothing to write."""

    recorder = NO_TRAFFIC

    def tick(self, now: float) -> None:
        pass

    def close(self) -> None:
        pass


def namespaces(ledger: Any) -> Callable[[SessionId], Optional[str]]:
    """A session's namespace, as a line names it (hex); None for a session the
    ledger does not know (a call it refuses)."""
    def of(sid: SessionId) -> Optional[str]:
        s = ledger.sessions.get(sid)
        return None if s is None else s.ns.id.hex()
    return of


def open_traffic(config: Any, ledger: Any) -> "TrafficFile | NoTrafficFile":
    """The config's traffic file, opened, recording the ledger's namespaces."""
    lg = config.ledger
    if not lg.traffic_file:
        return NoTrafficFile()
    with blame(config, "ledger.traffic_file", "cannot record traffic there", PATH_ERRNOS,
               path=lg.traffic_file):
        out = TrafficFile(lg.traffic_file, lg.traffic_requests, namespaces(ledger))
    log.info("recording traffic to %s (at most %d requests; ledger.traffic_file)",
             lg.traffic_file, lg.traffic_requests)
    return out


KEYS = ("ledger.traffic_file", "ledger.traffic_requests")


def reload_traffic(current: "TrafficFile | NoTrafficFile", old: Any, new: Any, ledger: Any,
                   plan: Any) -> "tuple[TrafficFile | NoTrafficFile, Any]":
    """The traffic file after a reload from config `old` to `new`, and `new`
    as applied: unchanged keys keep the running file; a file that cannot be
    opened keeps it too (logged, the keys left out of plan.applied and of the
    config). The file it replaces is closed, its open requests written, on a
    thread of its own: the event loop goes on serving."""
    lo, ln = old.ledger, new.ledger
    if (lo.traffic_file, lo.traffic_requests) == (ln.traffic_file, ln.traffic_requests):
        return current, new
    try:
        fresh = open_traffic(new, ledger)
    except ConfigError as e:
        log.error("reload: %s not changed: %s", KEYS[0], e,
                  extra={"event": "reload_refused", "key": KEYS[0]})
        plan.applied = [k for k in plan.applied if k not in KEYS]
        kept = replace(ln, traffic_file=lo.traffic_file, traffic_requests=lo.traffic_requests)
        return current, replace(new, ledger=kept)
    threading.Thread(target=current.close, name="kvkeeper-traffic-close").start()
    if isinstance(fresh, NoTrafficFile):
        log.info("reload: traffic recording off")
    return fresh, new
