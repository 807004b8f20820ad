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
