"""kvkeeper.server.ops.logsetup: text and JSON lines, extra fields, runtime changes."""
from __future__ import annotations

import io
import json
import logging

import pytest

from kvkeeper.server.ops import logsetup


@pytest.fixture
def stream():
    root = logging.getLogger()
    saved = (root.level, list(root.handlers))
    out = io.StringIO()
    yield out
    if logsetup._handler is not None:
        root.removeHandler(logsetup._handler)
        logsetup._handler = None
    root.setLevel(saved[0])


def test_json_lines_carry_the_fields_and_extras(stream) -> None:
    logsetup.configure("info", "json", stream)
    log = logging.getLogger("kvkeeper.test")
    log.info("hello %s", "world", extra={"event": "greeting", "count": 3, "level": "shadowed"})
    log.debug("not shown")
    try:
        raise ValueError("boom")
    except ValueError:
        log.exception("failed")
    lines = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert len(lines) == 2
    first = lines[0]
    assert (first["level"], first["logger"], first["msg"]) == ("INFO", "kvkeeper.test", "hello world")
    assert (first["event"], first["count"]) == ("greeting", 3)
    assert first["ts"].endswith("Z") and "T" in first["ts"]
    assert lines[1]["level"] == "ERROR" and "ValueError: boom" in lines[1]["exc"]


def test_text_lines_show_extras(stream) -> None:
    logsetup.configure("info", "text", stream)
    logging.getLogger("kvkeeper.test").warning("careful", extra={"event": "x"})
    line = stream.getvalue().strip()
    assert " WARNING kvkeeper.test: careful event=x" in line


def test_level_and_format_change_at_runtime(stream) -> None:
    logsetup.configure("warning", "text", stream)
    log = logging.getLogger("kvkeeper.test")
    log.info("hidden")
    logsetup.set_level("debug")
    logsetup.set_format("json")
    log.debug("shown")
    out = stream.getvalue()
    assert "hidden" not in out
    assert json.loads(out.strip())["msg"] == "shown"


def test_configure_twice_keeps_one_handler(stream) -> None:
    logsetup.configure("info", "text", stream)
    logsetup.configure("info", "text", stream)
    logging.getLogger("kvkeeper.test").info("once")
    assert stream.getvalue().count("once") == 1


def test_unknown_format() -> None:
    with pytest.raises(ValueError):
        logsetup.make_formatter("xml")
