"""DaemonLink and Releaser against a real daemon process that is missing, killed, restarted."""
from __future__ import annotations

import shutil
import time
from typing import Iterator

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
        assert time.monotonic() - t < 0.1
        d.start()  # a new daemon, empty, on the same socket
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
        assert time.monotonic() - t < 0.1
        d.resume()
        assert until(lambda: link.call(lambda c: c.match([key]), "lookup")).matched == 0
    finally:
        d.resume()
        link.close()
        d.cleanup()


class _FakeClient:
    session_id = "s"
    transport = "fake"

    def close(self) -> None:
        pass


def test_submit_runs_off_the_callers_thread_and_honours_the_breaker() -> None:
    import threading

    from kvkeeper.connector.link import DaemonLink

    now = [0.0]
    link = DaemonLink("unix:///nowhere", NS, instance_id="t", timeout=1.0,
                      connect=lambda *a, **k: _FakeClient(), clock=lambda: now[0],
                      reconnect_min_s=1.0)
    try:
        caller = threading.get_ident()
        assert link.submit(lambda c: threading.get_ident(), "x").result(5) != caller
        # a transport failure opens the breaker: the next submits fail at once
        failed = link.submit(lambda c: (_ for _ in ()).throw(UnavailableError("gone")), "x")
        with pytest.raises(UnavailableError):
            failed.result(5)
        refused = link.submit(lambda c: 1, "x")
        assert refused.done()
        with pytest.raises(LinkDown):
            refused.result()
        now[0] += 1.0                          # the backoff is over: the next call probes
        assert link.submit(lambda c: 2, "x").result(5) == 2
    finally:
        link.close()


def test_close_fails_queued_submits_and_does_not_wait_for_a_running_one() -> None:
    import threading

    from kvkeeper.connector.link import DaemonLink

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
    from kvkeeper.connector.link import DaemonLink

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
