"""A session with the daemon that may not be there: lazy connect, circuit breaker, a watcher.

vLLM must keep serving (by recomputing) while the daemon is down, slow or
restarting, and must start even when the daemon is not up yet. `DaemonLink`
wraps kvkeeper.client.Client for that:

* nothing connects until the first use (no gRPC channel exists across the
  forks vLLM makes at start-up); a failed connect is retried on a later use,
  no sooner than a backoff period (reconnect_min_s doubling to
  reconnect_max_s: 0.1 s to 0.5 s by default);
* after a transport failure (UNAVAILABLE, a deadline, ...) of a connected
  session the breaker opens: every call answers LinkDown at once, so no
  lookup waits for a dead or hung daemon. A watcher thread then probes the
  daemon (Client.renew: a heartbeat that registers a new session when the
  daemon lost ours) at the same backoff, and the first probe that succeeds
  closes the breaker: recovery follows the daemon coming back, within one
  probe interval (<= reconnect_max_s) plus the channel's own reconnect
  backoff (<= 0.5 s, client/aio.py), and the session, with its new
  shared-memory arena, is already registered again for the next call. A
  hung daemon costs the watcher one deadline per probe, never a caller;
* what the client already does is left to it: retrying idempotent calls,
  reconnecting the channel, registering again after the daemon restarted or
  the session expired, falling back from shared memory to streaming;
* `submit` runs a call on the link's own thread and returns a Future at
  once, so vLLM's scheduler never waits for the daemon (lookups). The extra
  thread hop costs about 0.1 ms per call (median, measured on a busy 2-core
  CPU: a 64-key Match went from about 1.4 to 1.55 ms); the breaker applies as
  for `call`: while it is open the Future is already failed with LinkDown and
  nothing is queued;
* `close` closes the session with a short deadline (the daemon frees its
  leases at once, not after the lease TTL) and is also run at interpreter
  exit for links still open, so an engine that shuts down without calling
  the connector's shutdown() frees its leases too;
* and on SIGTERM or SIGINT, before the handler that was there: vLLM's
  engine core takes SIGTERM as the request to stop, and its front end
  SIGKILLs it right after (vLLM's shutdown_timeout is 0 by default, "mode
  abort"), while it still waits for its workers: it never reaches its
  scheduler's shutdown, nor the interpreter's exit. A link made in a
  process's main thread chains that close in front of the signals'
  handlers (vLLM installs its own before it builds the scheduler). In a
  draining shutdown (shutdown_timeout > 0) the requests still running then
  recompute what they would have loaded. Where the kill comes first anyway,
  the client's session watch (client/watch.py) ends with the process's
  connection and the daemon frees the session's leases all the same.
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import signal
import threading
import time
import weakref
from concurrent.futures import Future
from typing import Any, Callable, Mapping, Optional, TypeVar

import grpc

from kvkeeper.client import Client, KVKeeperClientError
from kvkeeper.client.checksum import DEFAULT as DEFAULT_CHECKSUM
from kvkeeper.client.refusal import REFUSED_CODES, REFUSED_MAX_S, REFUSED_MIN_S

__all__ = ["DaemonLink", "LinkDown", "is_transport_failure"]

log = logging.getLogger("kvkeeper.connector")

T = TypeVar("T")

_STOP = object()

_TRANSPORT_CODES = {grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED,
                    grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN,
                    grpc.StatusCode.CANCELLED, grpc.StatusCode.ABORTED}


# Seconds a closing link gives CloseSession: shutdown must not hold an engine
# that vLLM kills after a few seconds (its workers get 5 s by default).
CLOSE_TIMEOUT_S = 0.5

_open_links: "weakref.WeakSet[DaemonLink]" = weakref.WeakSet()
_CLOSE_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_hooked_pid = 0     # the process whose signal handlers close the links (forks re-hook)


class LinkDown(Exception):
    """No usable session right now: never connected yet, connecting, or the
    daemon failed and has not answered a probe since."""


def is_transport_failure(exc: BaseException) -> bool:
    """Whether `exc` says the daemon is unreachable or unhealthy (rather than
    that one request was wrong, e.g. an unknown lease or a full tier)."""
    if isinstance(exc, KVKeeperClientError):
        return exc.code is None or exc.code in _TRANSPORT_CODES
    if isinstance(exc, grpc.RpcError):
        code = exc.code() if callable(getattr(exc, "code", None)) else None
        return code in _TRANSPORT_CODES
    return isinstance(exc, (OSError, RuntimeError, TimeoutError))


def _wait(event: threading.Event, seconds: float) -> bool:
    return event.wait(seconds)


class DaemonLink:
    """One namespace's session with the daemon, probed back after a failure."""

    def __init__(self, url: str, namespace: Mapping[str, Any], *, instance_id: str,
                 timeout: float, max_retries: int = 1, transport: str = "auto",
                 checksum: str = DEFAULT_CHECKSUM, reconnect_min_s: float = 0.1,
                 reconnect_max_s: float = 0.5, name: str = "kvkeeper",
                 token: Optional[str] = None, tls: Any = None,
                 connect: Optional[Callable[..., Any]] = None,
                 clock: Callable[[], float] = time.monotonic,
                 wait: Callable[[threading.Event, float], bool] = _wait) -> None:
        self.url = url
        self.namespace = dict(namespace)
        self.name = name
        self._instance_id = instance_id
        self._timeout = timeout
        self._max_retries = max_retries
        self._transport = transport
        self._checksum = checksum
        self._credentials = {"token": token, "tls": tls}   # client.auth: token=, tls=
        # Threads a large save or load copies with (client/copies.py; 0: auto);
        # set before the first connect, which passes it on.
        self.copy_threads = 0
        self._min = reconnect_min_s
        self._max = reconnect_max_s
        self._connect = connect or Client.connect
        self._clock = clock
        self._lock = threading.Lock()
        self._client: Any = None
        self._connecting = False
        self._closed = False
        self._not_before = 0.0      # no attempt (connect or call) before this time
        self._delay = reconnect_min_s
        self._failing = False       # for logging: warn once per outage
        self._connected_once = False   # until then, a connect may block its caller
        self._jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()   # for submit()
        self._worker: Optional[threading.Thread] = None
        self._down = False          # the breaker: open until a probe succeeds
        self._watcher: Optional[threading.Thread] = None
        self._wake = threading.Event()   # set by close(): the watcher stops
        self._wait = wait           # wait(event, seconds) -> whether it was set
        self.probes = 0             # probes made (tests, logs)
        _open_links.add(self)
        _close_on_signals()

    # ---- state

    @property
    def connected(self) -> bool:
        return self._client is not None

    @property
    def up(self) -> bool:
        """Connected, and no failure since the last success."""
        return self._client is not None and not self._down and not self._closed

    def session_id(self) -> str:
        c = self._client
        return c.session_id if c is not None else ""

    def _backoff(self, now: float, refused: bool = False) -> float:
        # Refused (the token, the session limit): asking again soon gets the same answer.
        delay = max(self._delay, REFUSED_MIN_S) if refused else self._delay
        self._not_before = now + delay
        self._delay = min(REFUSED_MAX_S if refused else self._max, delay * 2)
        return delay

    def _ok(self) -> None:
        if self._failing:
            log.info("%s: daemon at %s reachable again", self.name, self.url)
        self._failing = False
        self._down = False
        self._delay = self._min
        self._not_before = 0.0

    def _report(self, what: str, exc: BaseException, delay: float) -> None:
        if not self._failing:
            log.warning("%s: %s failed (%s); continuing without the daemon, trying again in "
                        "%.1f s and backing off", self.name, what, exc, delay)
        else:
            log.debug("%s: %s failed again (%s); next try in %.1f s", self.name, what, exc, delay)
        self._failing = True

    # ---- the breaker and its watcher

    def _trip(self, what: str, exc: BaseException) -> None:
        """A connected session failed: answer LinkDown until a probe succeeds."""
        with self._lock:
            if self._closed or self._client is None:
                return
            self._report(what, exc, self._min)
            self._down = True
            if self._watcher is None:
                self._watcher = threading.Thread(target=self._watch, name=f"{self.name}-watch",
                                                 daemon=True)
                self._watcher.start()

    def _watch(self) -> None:
        delay = self._min
        while True:
            if self._wait(self._wake, delay):
                return   # closed
            with self._lock:
                client = self._client
                if self._closed or client is None or not self._down:
                    self._watcher = None
                    return
            self.probes += 1
            try:
                client.renew()
            except Exception as e:  # noqa: BLE001 - still down (or hung): probe again
                log.debug("%s: probe failed (%s); next in %.1f s", self.name, e,
                          min(self._max, delay * 2))
                delay = min(self._max, delay * 2)
                continue
            with self._lock:
                self._watcher = None
                if not self._closed:
                    self._ok()
            return

    # ---- connecting

    def _do_connect(self) -> Any:
        try:
            client = self._connect(self.url, self.namespace, instance_id=self._instance_id,
                                   timeout=self._timeout, transport=self._transport,
                                   checksum=self._checksum, max_retries=self._max_retries,
                                   copy_threads=self.copy_threads,
                                   call_timeout=self._timeout * (self._max_retries + 2) + 1.0,
                                   **self._credentials)
        except Exception as e:
            with self._lock:
                self._connecting = False
                delay = self._backoff(self._clock(), getattr(e, "code", None) in REFUSED_CODES)
                self._report("connecting", e, delay)
            raise
        with self._lock:
            self._connecting = False
            if self._closed:
                closed = True
            else:
                closed = False
                self._client = client
                self._connected_once = True
                self._ok()
        if closed:
            _close_quietly(client)
            raise LinkDown("link closed while connecting")
        log.info("%s: session %s with %s (transport %s)", self.name, client.session_id,
                 self.url, client.transport)
        return client

    def _background_connect(self) -> None:
        try:
            self._do_connect()
        except Exception:  # logged by _do_connect
            pass

    def client(self, wait: bool = True) -> Any:
        """The connected client, or LinkDown.

        With no client yet and an attempt due: until the link has connected
        once, a caller with wait=True connects in its own thread (bounded by
        the timeout), so the first use after the daemon came up can already
        succeed (a daemon started after vLLM is the usual case at boot; the
        callers then are the submit thread, worker I/O and save threads, and
        a worker only loads after the scheduler's link got a hit). Once it
        has connected, reconnects run in the background and this call raises
        LinkDown, so a daemon that went down or black-holed never stalls a
        caller more than once per backoff period.
        """
        with self._lock:
            if self._closed:
                raise LinkDown("link closed")
            if self._down:
                raise LinkDown("daemon unreachable; probing it")
            now = self._clock()
            if now < self._not_before:
                raise LinkDown(f"daemon unreachable; next try in {self._not_before - now:.1f} s")
            if self._client is not None:
                return self._client
            if self._connecting:
                raise LinkDown("connecting to the daemon")
            self._connecting = True
            wait = wait and not self._connected_once
        if wait:
            try:
                return self._do_connect()
            except LinkDown:
                raise
            except Exception as e:
                raise LinkDown(f"cannot connect to {self.url}: {e}") from e
        threading.Thread(target=self._background_connect, name=f"{self.name}-connect",
                         daemon=True).start()
        raise LinkDown("connecting to the daemon")

    def call(self, fn: Callable[[Any], T], what: str, wait: bool = True) -> T:
        """fn(client); a transport failure opens the breaker and propagates."""
        c = self.client(wait)
        try:
            return fn(c)
        except Exception as e:
            if is_transport_failure(e):
                self._trip(what, e)
            raise

    def submit(self, fn: Callable[[Any], T], what: str) -> Future[T]:
        """call(fn, what) on this link's thread; returns its Future at once.

        Never blocks: a closed link or an open breaker gives a Future that
        already failed with LinkDown. Calls run one at a time, in order (each
        bounded by the link's timeout; after a transport failure the breaker
        fails the queued ones at once). Until the link has connected once, a
        due connect happens on that thread too (see client()), so the first
        call after the daemon came up can already succeed. close() fails the
        calls still queued with LinkDown and does not wait for a running one.
        """
        fut: Future[T] = Future()
        with self._lock:
            if self._closed:
                fut.set_exception(LinkDown("link closed"))
                return fut
            if self._down:
                fut.set_exception(LinkDown("daemon unreachable; probing it"))
                return fut
            now = self._clock()
            if now < self._not_before:
                fut.set_exception(LinkDown(
                    f"daemon unreachable; next try in {self._not_before - now:.1f} s"))
                return fut
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name=f"{self.name}-calls",
                                                daemon=True)
                self._worker.start()
            self._jobs.put((fut, fn, what))
        return fut

    def _work(self) -> None:
        while True:
            item = self._jobs.get()
            if item is _STOP:
                return
            fut, fn, what = item
            if not fut.set_running_or_notify_cancel():
                continue
            try:
                out = self.call(fn, what)
            except BaseException as e:  # noqa: BLE001 - handed to the waiter
                fut.set_exception(e)
            else:
                fut.set_result(out)

    def close(self, timeout: float = CLOSE_TIMEOUT_S) -> None:
        """Close the session (the daemon releases its leases at once), giving
        CloseSession `timeout` seconds. Idempotent; never waits for a call in
        progress on the submit thread."""
        with self._lock:
            self._closed = True
            client, self._client = self._client, None
            worker, self._worker = self._worker, None
        self._wake.set()
        _open_links.discard(self)
        if worker is not None:
            while True:   # fail what is still queued; the thread ends at _STOP
                try:
                    item = self._jobs.get_nowait()
                except queue.Empty:
                    break
                if item is not _STOP and item[0].set_running_or_notify_cancel():
                    item[0].set_exception(LinkDown("link closed"))
            self._jobs.put(_STOP)
        if client is not None:
            _close_quietly(client, timeout)


def _close_quietly(client: Any, timeout: float = CLOSE_TIMEOUT_S) -> None:
    try:
        client.close(timeout=timeout)
    except Exception as e:  # the daemon expires the session by itself
        log.debug("kvkeeper: closing the client failed: %s", e)


@atexit.register
def _close_open_links() -> None:
    """At interpreter exit, close the sessions nobody closed (an engine that
    exits without the connector's shutdown): their leases are freed now."""
    for link in list(_open_links):
        link.close()


def _close_links_soon(timeout: float) -> None:
    """Close the open links on another thread, waiting at most `timeout` (plus
    a little): a signal handler runs in the main thread, which may have been
    interrupted while holding a link's lock."""
    t = threading.Thread(target=_close_open_links, name="kvkeeper-signal-close", daemon=True)
    t.start()
    t.join(timeout + 0.1)


def _chained(previous: Any) -> Callable[[int, Any], None]:
    def handler(signum: int, frame: Any) -> None:
        _close_links_soon(CLOSE_TIMEOUT_S)
        if callable(previous):
            previous(signum, frame)
        elif previous != signal.SIG_IGN:   # SIG_DFL (or None: not set from Python)
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
    return handler


def _close_on_signals() -> None:
    """Once per process, from its main thread (the only one that may set
    handlers): close the open links on _CLOSE_SIGNALS, then run the handler
    that was there."""
    global _hooked_pid
    if _hooked_pid == os.getpid() or threading.current_thread() is not threading.main_thread():
        return
    _hooked_pid = os.getpid()
    for sig in _CLOSE_SIGNALS:
        try:
            signal.signal(sig, _chained(signal.getsignal(sig)))
        except (ValueError, OSError) as e:   # e.g. an embedding interpreter
            log.debug("kvkeeper: cannot close sessions on %s: %s", sig.name, e)
