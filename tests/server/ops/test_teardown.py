"""kvkeeper.server.ops.teardown: every shutdown step runs; the first failure is
raised after the last step."""
from __future__ import annotations

import logging

import pytest

from kvkeeper.server.ops.teardown import run_all, run_all_now, unlink_present


async def test_every_step_runs_and_the_first_failure_is_raised(caplog) -> None:
    done: list[str] = []

    def fail(what: str) -> None:
        done.append(what)
        raise RuntimeError(what)

    async def later() -> None:
        done.append("async")

    with caplog.at_level(logging.ERROR, logger="kvkeeper"):
        with pytest.raises(RuntimeError, match="first"):
            await run_all([("a", lambda: fail("first")), ("b", later),
                           ("c", lambda: fail("second")), ("d", lambda: done.append("last"))])
    assert done == ["first", "async", "second", "last"]
    assert [r.step for r in caplog.records] == ["a", "c"]


async def test_no_failure_raises_nothing() -> None:
    done: list[int] = []
    await run_all([("one", lambda: done.append(1))])
    assert done == [1]


def test_run_all_now_runs_every_plain_step_and_raises_the_first_failure(caplog) -> None:
    done: list[str] = []

    def fail(what: str) -> None:
        done.append(what)
        raise OSError(what)

    with caplog.at_level(logging.ERROR, logger="kvkeeper"):
        with pytest.raises(OSError, match="first"):
            run_all_now([("a", lambda: fail("first")), ("b", lambda: fail("second")),
                          ("c", lambda: done.append("last"))])
    assert done == ["first", "second", "last"]
    assert [r.step for r in caplog.records] == ["a", "b"]


def test_unlink_present_removes_a_file_and_passes_over_none_or_a_missing_one(tmp_path) -> None:
    f = tmp_path / "kvk.sock"
    f.write_text("")
    unlink_present(str(f))
    assert not f.exists()
    unlink_present(str(f))
    unlink_present(None)
