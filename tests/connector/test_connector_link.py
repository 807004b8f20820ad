"""DaemonLink and Releaser against a real daemon process that is missing, killed, restarted."""
from __future__ import annotations

import shutil
import time
from typing import Iterator

import grpc
import pytest

from connector_harness import DaemonProcess, short_tmpdir
from kvkeeper.client import DeadlineExceededError, UnavailableError
from kvkeeper.connector.keys import KEY_BYTES
from kvkeeper.connector.link import DaemonLink, LinkDown
from kvkeeper.connector.releaser import Releaser

NS = {"model_id": "link-test", "dtype": "float32", "kv_layout": "x", "block_tokens": 16,
      "block_bytes": 4096, "tp_rank": 0, "tp_size": 1}


@pytest.fixture
def sock() -> Iterator[str]:
    d = short_tmpdir()
    yield f"{d}/kvk.sock"
    shutil.rmtree(d, ignore_errors=True)


def link_for(sock: str, **kw) -> DaemonLink:
    kw.setdefault("reconnect_min_s", 0.2)
    kw.setdefault("reconnect_max_s", 0.8)
    return DaemonLink(f"unix://{sock}", NS, instance_id="link-test", timeout=1.0, max_retries=1,
                      **kw)


def until(fn, timeout: float = 15.0):
    """fn() until it stops raising LinkDown / UnavailableError."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            return fn()
        except (LinkDown, UnavailableError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.1)


def test_missing_daemon_fails_fast_then_connects_when_it_comes(sock: str) -> None:
    link = link_for(sock)
    try:
        t = time.monotonic()
        with pytest.raises(LinkDown):
            link.call(lambda c: c.match([b"k" * KEY_BYTES]), "lookup")
        with pytest.raises(LinkDown):   # backing off: no attempt, no wait
            link.call(lambda c: c.match([b"k" * KEY_BYTES]), "lookup")
        assert time.monotonic() - t < 3.0
        d = DaemonProcess(sock).start()
        try:
            res = until(lambda: link.call(lambda c: c.match([b"k" * KEY_BYTES]), "lookup"))
            assert res.matched == 0 and link.connected
        finally:
            d.cleanup()
    finally:
        link.close()


def test_killed_daemon_opens_the_breaker_and_a_restart_closes_it(sock: str) -> None:
    d = DaemonProcess(sock).start()
    link = link_for(sock)
    block = bytes(range(256)) * 16
    key = b"\x01" * KEY_BYTES
    try:
        assert link.call(lambda c: c.save([key], [block]), "save").committed == 1
        d.kill()
        with pytest.raises((UnavailableError, LinkDown)):
            link.call(lambda c: c.match([key]), "lookup")
        t = time.monotonic()
        with pytest.raises(LinkDown):  # the breaker answers without touching the daemon
            link.call(lambda c: c.match([key]), "lookup")
        assert time.monotonic() - t < 0.5   # no RPC: well under the 1 s deadline, with room for a loaded CI host
        old_session = link.session_id()
        d.start()  # a new daemon, empty, on the same socket
        # the watcher finds it and registers a new session: no caller has to
        wait_until(lambda: link.up, "the link did not come back by itself", timeout=15.0)
        assert link.session_id() != old_session and d.stats().sessions == 1
        res = until(lambda: link.call(lambda c: c.match([key]), "lookup"))
        assert res.matched == 0, "the restarted daemon is empty"
        assert until(lambda: link.call(lambda c: c.save([key], [block]), "save")).committed == 1
        assert link.call(lambda c: c.match([key]), "lookup").matched == 1
    finally:
        link.close()
        d.cleanup()


def test_releaser_releases_and_drops_unknown_leases(sock: str) -> None:
    d = DaemonProcess(sock).start()
    link = link_for(sock)
    rel = Releaser(link, give_up_s=5.0, retry_s=0.1)
    key = b"\x02" * KEY_BYTES
    try:
        link.call(lambda c: c.save([key], [bytes(4096)]), "save")
        m = link.call(lambda c: c.match([key], lease=True), "lookup")
        assert d.stats().leases == 1
        rel.release(m.lease_id)
        rel.release(10 ** 9)              # never issued: NOT_FOUND, dropped
        rel.release(m.lease_id)           # twice: FAILED_PRECONDITION, dropped
        assert rel.flush(10.0)
        assert d.stats().leases == 0 and rel.stats() == (1, 0)
        m = link.call(lambda c: c.match([key], lease=True), "lookup")
        rel.release(m.lease_id, discard=True)
        assert rel.flush(10.0)
        assert link.call(lambda c: c.match([key]), "lookup").matched == 0, "discarded"
    finally:
        rel.close()
        link.close()
        d.cleanup()


def test_releaser_sends_each_call_its_delay_after_it_was_queued_in_order() -> None:
    """A release waits DELAY_S (the step's output goes first), calls stay in order."""
    sent: list = []

    class Link:
        name = "fake"

        def call(self, fn, what):
            return fn(self)

        def release(self, lid, **kw):
            sent.append((lid, time.monotonic()))

        def narrow(self, lid, start, count):
            sent.append((("narrow", lid), time.monotonic()))

    rel = Releaser(Link(), delay_s=0.2)   # type: ignore[arg-type]
    try:
        t0 = time.monotonic()
        rel.release(7)
        rel.narrow(8, 0, 1)
        rel.release(8)
        time.sleep(0.1)
        assert sent == [], "sent before its delay"
        assert rel.flush(5.0)
        assert [s for s, _ in sent] == [7, ("narrow", 8), 8]
        assert all(at - t0 >= 0.2 for _, at in sent)
        assert sent[-1][1] - t0 < 0.2 + 1.0, "later calls do not wait again"
    finally:
        rel.close()


def test_a_hung_daemon_costs_one_deadline_then_the_breaker_answers(sock: str) -> None:
    d = DaemonProcess(sock).start()
    link = link_for(sock)   # 1 s deadline per RPC
    key = b"\x03" * KEY_BYTES
    try:
        assert link.call(lambda c: c.match([key]), "lookup").matched == 0
        d.pause()
        t = time.monotonic()
        with pytest.raises((DeadlineExceededError, UnavailableError)):
            link.call(lambda c: c.match([key]), "lookup")
        assert time.monotonic() - t < 3.5
        t = time.monotonic()
        with pytest.raises(LinkDown):
            link.call(lambda c: c.match([key]), "lookup")
        assert time.monotonic() - t < 0.5   # no RPC: well under the 1 s deadline, with room for a loaded CI host
        d.resume()
        assert until(lambda: link.call(lambda c: c.match([key]), "lookup")).matched == 0
    finally:
        d.resume()
        link.close()
        d.cleanup()


class _FakeClient:
    """A connected client whose renew() (the watcher's probe) fails while `down`."""

    session_id = "s"
    transport = "fake"

    def __init__(self, down_for: int = 0) -> None:
        self.down_for = down_for   # renew() fails this many times, then succeeds
        self.renews = 0
        self.closed_with: list = []

    def renew(self) -> None:
        self.renews += 1
        if self.renews <= self.down_for:
            raise UnavailableError("daemon down")

    def close(self, timeout=None) -> None:
        self.closed_with.append(timeout)


def _fail(exc):
    def fn(c):
        raise exc
    return fn


def wait_until(cond, what: str, timeout: float = 10.0) -> None:
    """Wait for a state the link's own threads reach (a bound, not a timing check)."""
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, what
        time.sleep(0.005)


def test_submit_runs_off_the_callers_thread_and_honours_the_breaker() -> None:
    import threading

    fake = _FakeClient(down_for=1)
    gate = threading.Event()
    link = DaemonLink("unix:///nowhere", NS, instance_id="t", timeout=1.0,
                      connect=lambda *a, **k: fake, wait=lambda ev, d: not gate.wait(10))
    try:
        caller = threading.get_ident()
        assert link.submit(lambda c: threading.get_ident(), "x").result(5) != caller
        # a transport failure opens the breaker: the next submits fail at once
        failed = link.submit(_fail(UnavailableError("gone")), "x")
        with pytest.raises(UnavailableError):
            failed.result(5)
        refused = link.submit(lambda c: 1, "x")
        assert refused.done() and not link.up
        with pytest.raises(LinkDown):
            refused.result()
        gate.set()                       # let the watcher probe: fails once, then succeeds
        wait_until(lambda: link.up, "the watcher's probe did not close the breaker")
        assert fake.renews == 2
        assert link.submit(lambda c: 2, "x").result(5) == 2
    finally:
        link.close()


def test_the_watcher_probes_at_a_capped_backoff_and_callers_never_wait() -> None:
    fake = _FakeClient(down_for=6)
    delays = []
    calls = []
    link = DaemonLink("unix:///nowhere", NS, instance_id="t", timeout=1.0,
                      connect=lambda *a, **k: fake, reconnect_min_s=0.1, reconnect_max_s=1.0,
                      wait=lambda ev, d: delays.append(d) and False)
    try:
        link.call(lambda c: None, "connect")
        with pytest.raises(DeadlineExceededError):
            link.call(_fail(DeadlineExceededError("hung")), "lookup")
        wait_until(lambda: link.up, "the daemon answered but the breaker stayed open")
        # 6 failed probes, then one that succeeded; the interval never exceeds 1 s
        assert delays == pytest.approx([0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0])
        assert fake.renews == link.probes == 7
        assert link.call(lambda c: calls.append(1) or "ok", "lookup") == "ok"
        assert calls == [1]
        # not a transport failure (e.g. an unknown lease): the breaker stays closed
        from kvkeeper.client import NotFoundError
        with pytest.raises(NotFoundError):
            link.call(_fail(NotFoundError("no such lease", grpc.StatusCode.NOT_FOUND)), "release")
        assert link.up and link.probes == 7
    finally:
        link.close()


def test_while_the_breaker_is_open_calls_are_refused_without_running() -> None:
    import threading

    fake = _FakeClient(down_for=10 ** 9)   # never comes back
    ran = []
    link = DaemonLink("unix:///nowhere", NS, instance_id="t", timeout=1.0,
                      connect=lambda *a, **k: fake, wait=lambda ev, d: ev.wait(0.01))
    link.call(lambda c: None, "connect")
    with pytest.raises(UnavailableError):
        link.call(_fail(UnavailableError("gone")), "save")
    for _ in range(3):
        with pytest.raises(LinkDown):
            link.call(lambda c: ran.append(1), "lookup")
    assert ran == []
    wait_until(lambda: fake.renews >= 2, "the watcher does not probe")
    link.close()
    # close() stops the watcher and closes the session with the short deadline
    wait_until(lambda: not any(t.name.endswith("-watch") and t.is_alive()
                               for t in threading.enumerate()), "the watcher outlived close()")
    from kvkeeper.connector.link import CLOSE_TIMEOUT_S
    assert fake.closed_with == [CLOSE_TIMEOUT_S] and CLOSE_TIMEOUT_S <= 1.0


def run_with_open_link(closed_path, before: str = "", after: str = "") -> int:
    """Exit status of a Python process that runs `before`, opens a DaemonLink
    (a fake client whose close writes its timeout to closed_path), then runs `after`."""
    import subprocess
    import sys

    code = f"""
{before}
from kvkeeper.connector.link import DaemonLink
class C:
    session_id = "s"; transport = "fake"
    def close(self, timeout=None):
        open({str(closed_path)!r}, "w").write(repr(timeout))
link = DaemonLink("unix:///nowhere", {{"model_id": "m", "block_bytes": 1}}, instance_id="t",
                  timeout=1.0, connect=lambda *a, **k: C())
link.call(lambda c: None, "connect")
{after}
"""
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    print(r.stderr[-2000:])
    return r.returncode


def test_links_left_open_are_closed_at_interpreter_exit(tmp_path) -> None:
    """An engine that exits without the connector's shutdown still closes its
    sessions (the daemon frees their leases at once)."""
    out = tmp_path / "closed"
    assert run_with_open_link(out) == 0
    assert out.read_text() == "0.5"


@pytest.mark.parametrize("previous", ["exit", "default"])
def test_sigterm_closes_open_links_before_the_previous_handler(tmp_path, previous: str) -> None:
    """vLLM's engine core is SIGKILLed right after its SIGTERM handler ran, before
    its scheduler's shutdown and atexit: the close must come first. "exit": a
    handler set before the link (as vLLM sets its own) that ends the process
    without atexit; "default": none, the signal then kills the process as usual."""
    import signal

    out = tmp_path / "closed"
    before = ("import os, signal, time\n"
              + ("signal.signal(signal.SIGTERM, lambda s, f: os._exit(7))"
                 if previous == "exit" else ""))
    rc = run_with_open_link(out, before, "os.kill(os.getpid(), signal.SIGTERM)\ntime.sleep(30)")
    assert rc == (7 if previous == "exit" else -signal.SIGTERM)
    assert out.read_text() == "0.5"


def test_close_fails_queued_submits_and_does_not_wait_for_a_running_one() -> None:
    import threading

    link = DaemonLink("unix:///nowhere", NS, instance_id="t", timeout=1.0,
                      connect=lambda *a, **k: _FakeClient())
    gate, started = threading.Event(), threading.Event()

    def slow(c):
        started.set()
        gate.wait(10)
        return "late"

    running = link.submit(slow, "x")
    assert started.wait(5)
    queued = link.submit(lambda c: 1, "x")
    link.close()                               # returns while `slow` still runs
    with pytest.raises(LinkDown):
        queued.result(5)
    assert not running.done()
    gate.set()
    assert running.result(5) == "late"
    with pytest.raises(LinkDown):
        link.submit(lambda c: 1, "x").result()


def test_submit_against_a_real_daemon(sock: str) -> None:
    d = DaemonProcess(sock).start()
    link = link_for(sock)
    key = b"\x04" * KEY_BYTES
    try:
        link.call(lambda c: c.save([key], [bytes(4096)]), "save")
        res = link.submit(lambda c: c.match([key], lease=True), "lookup").result(10)
        assert res.matched == 1 and res.lease_id
        link.call(lambda c: c.release(res.lease_id), "release")
    finally:
        link.close()
        d.cleanup()


def test_until_connected_once_a_due_attempt_connects_in_the_callers_thread() -> None:
    # The daemon starts after vLLM: the first use after it came up succeeds
    # (a worker's first load must not fail because its start-up connect did).
    now = [0.0]
    up = [False]

    def connect(*a, **k):
        if not up[0]:
            raise UnavailableError("no daemon yet")
        return _FakeClient()

    link = DaemonLink("unix:///nowhere", NS, instance_id="t", timeout=1.0, connect=connect,
                      clock=lambda: now[0], reconnect_min_s=1.0)
    try:
        with pytest.raises(LinkDown):
            link.call(lambda c: 1, "connect")
        with pytest.raises(LinkDown):          # backing off: no attempt
            link.call(lambda c: 1, "load")
        up[0] = True
        now[0] += 1.0
        assert link.call(lambda c: 2, "load") == 2
    finally:
        link.close()
