"""start_load_kv breaking after the worker's own Match leased the blocks: vLLM
is told every block failed (it recomputes them) and the lease goes back to
the daemon, instead of staying pinned for the session's life."""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import pytest
from test_connector_worker import daemon, keys, save, tensors, worker  # noqa: F401 - fixture

from connector_harness import DaemonProcess
from kvkeeper.connector.connector import KVKeeperConnector
from kvkeeper.connector.guard import FailureLog
from kvkeeper.connector.load.halves import HalvesLoad
from kvkeeper.connector.metadata import KVKeeperConnectorMetadata, LoadSpec


def through_the_guard(w: Any, meta: KVKeeperConnectorMetadata) -> None:
    """KVKeeperConnector.start_load_kv (its guard and fallback) over worker side `w`."""
    conn = SimpleNamespace(hook_failures=FailureLog(), _worker=w,
                           has_connector_metadata=lambda: True,
                           _get_connector_metadata=lambda: meta)
    KVKeeperConnector.start_load_kv(conn, None)   # type: ignore[arg-type]


def leases_after(d: DaemonProcess, want: int, timeout: float = 5.0) -> int:
    deadline = time.monotonic() + timeout     # releases are sent in the background
    while d.stats().leases != want and time.monotonic() < deadline:
        time.sleep(0.05)
    return d.stats().leases


@pytest.mark.parametrize("placement,where", [
    ("inline", "start"), ("halves", "start"), ("beside", "start"),
    ("beside", "hashers")])   # layer by layer beside the forward: the job hashes as it copies
def test_a_load_that_breaks_after_its_lease_reports_failure_and_releases(
        daemon: DaemonProcess, monkeypatch: pytest.MonkeyPatch, placement: str,  # noqa: F811
        where: str) -> None:
    import kvkeeper.connector.load.copy_in as copy_in
    import kvkeeper.connector.worker as worker_mod

    cpus = frozenset({"inline": (), "halves": (0,), "beside": (0, 1)}[placement])
    monkeypatch.setattr(worker_mod, "spare_cpus", lambda: cpus)
    monkeypatch.setattr(HalvesLoad, "min_blocks", 2)
    a, b = worker(daemon.url, tensors(1)), worker(daemon.url, tensors(2))
    try:
        ks = keys(3, salt=7)
        save(a, ks, [0, 1, 2])

        def boom(*_: Any) -> None:
            raise RuntimeError("injected")
        if where == "start":
            monkeypatch.setattr(b.load_strategy, "start", boom)
        else:   # inside the copy job, before its first copy
            monkeypatch.setattr(copy_in.BlockLoader, "_hashers", boom)
        # No refs: the worker Matches the keys under a lease of its own.
        through_the_guard(b, KVKeeperConnectorMetadata(
            loads=[LoadSpec("r", (tuple(ks),), (3, 4, 5), load_id=1)]))
        for name in ("l0", "l1"):
            b.wait_for_layer_load(name)
        assert b.take_load_errors() == {3, 4, 5}
        assert b.build_worker_meta().loads_done == {1: {0: (0, ())}}
        assert leases_after(daemon, 0) == 0, "the worker's lease stayed pinned"
    finally:
        a.shutdown()
        b.shutdown()
