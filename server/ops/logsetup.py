"""The daemon's log output: one line per event on stderr, as text or as JSON.

JSON lines carry ts (UTC, ISO 8601), level, logger and msg, then every field a
call passed with `extra=` (e.g. `event`, `namespace`), so a log shipper can
filter on them without parsing messages. Text lines show the same extra fields
as key=value after the message.

Level and format may change while the daemon runs (a SIGHUP reload), so the
handler is installed once on the root logger and only reconfigured later.

What must never reach a log line: block keys and bearer tokens. Callers log
namespace ids (a digest of public model facts), session ids and counts.
"""
from __future__ import annotations

import json
import logging
import sys
import time
from typing import Any, Optional, TextIO

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# Attributes every LogRecord has; anything else on a record came from `extra=`.
_STANDARD = frozenset(vars(logging.LogRecord("", 0, "", 0, "", (), None))) | {
    "message", "asctime", "taskName"}

_handler: Optional[logging.Handler] = None


def extra_fields(record: logging.LogRecord) -> dict[str, Any]:
    return {k: v for k, v in vars(record).items() if k not in _STANDARD and not k.startswith("_")}


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, Any] = {
            "ts": time.strftime("%Y-%m-%dT%H:%M:%S", time.gmtime(record.created))
            + f".{int(record.msecs):03d}Z",
            "level": record.levelname,
            "logger": record.name,
            "msg": record.getMessage(),
        }
        for k, v in extra_fields(record).items():
            line.setdefault(k, v)  # an extra never hides ts, level, logger or msg
        if record.exc_info:
            line["exc"] = self.formatException(record.exc_info)
        if record.stack_info:
            line["stack"] = self.formatStack(record.stack_info)
        return json.dumps(line, default=str, ensure_ascii=False)


class TextFormatter(logging.Formatter):
    def __init__(self) -> None:
        super().__init__(TEXT_FORMAT)

    def formatMessage(self, record: logging.LogRecord) -> str:
        text = super().formatMessage(record)
        extras = extra_fields(record)
        if extras:
            text += " " + " ".join(f"{k}={v}" for k, v in extras.items())
        return text


def make_formatter(fmt: str) -> logging.Formatter:
    if fmt == "json":
        return JsonFormatter()
    if fmt == "text":
        return TextFormatter()
    raise ValueError(f"unknown log format {fmt!r}; use text or json")


def configure(level: str, fmt: str, stream: Optional[TextIO] = None) -> logging.Handler:
    """Send every log record at `level` or above to `stream` (stderr) in `fmt`."""
    global _handler
    root = logging.getLogger()
    if _handler is not None:
        root.removeHandler(_handler)
    _handler = logging.StreamHandler(stream if stream is not None else sys.stderr)
    _handler.setFormatter(make_formatter(fmt))
    root.addHandler(_handler)
    root.setLevel(level.upper())
    return _handler


def set_level(level: str) -> None:
    logging.getLogger().setLevel(level.upper())


def set_format(fmt: str) -> None:
    if _handler is not None:
        _handler.setFormatter(make_formatter(fmt))
