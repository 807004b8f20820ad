"""grpc's ERROR line for a call whose client had just left (a race inside grpc
that any client with short deadlines can trigger) is kept at DEBUG without its
traceback; every other grpc error stays an ERROR. Found by the stub fuzzer."""
from __future__ import annotations

import logging
import sys
from typing import Any

import pytest

from kvkeeper.server.ops import grpclog

GONE = "ExecuteBatchError raised in core by servicer method [/kvkeeper.v1.KVKeeper/Heartbeat]"


class Collect(logging.Handler):
    def __init__(self) -> None:
        super().__init__(logging.NOTSET)
        self.records: list[logging.LogRecord] = []

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)


@pytest.fixture
def grpc_log() -> Any:
    """grpc's server logger at `level`, with the filter installed; what reaches a handler above it."""
    logger = logging.getLogger(grpclog.GRPC_LOGGER)
    parent = logging.getLogger("grpc")
    seen = Collect()
    parent.addHandler(seen)
    level = logger.level
    grpclog.install()
    grpclog.install()   # idempotent

    def at(lvl: int) -> Any:
        logger.setLevel(lvl)
        return logger, seen

    yield at
    parent.removeHandler(seen)
    logger.setLevel(level)


def error_with_traceback(logger: logging.Logger, msg: str) -> None:
    try:
        raise RuntimeError('Failed "execute_batch"')
    except RuntimeError:
        logger.error(msg, exc_info=sys.exc_info())


def test_the_client_gone_error_is_not_emitted_at_info(grpc_log: Any) -> None:
    logger, seen = grpc_log(logging.INFO)
    error_with_traceback(logger, GONE)
    assert seen.records == []
    filters = logging.getLogger(grpclog.GRPC_LOGGER).filters
    assert sum(isinstance(f, grpclog.ClientGone) for f in filters) == 1


def test_the_client_gone_error_is_a_debug_line_without_traceback_at_debug(grpc_log: Any) -> None:
    logger, seen = grpc_log(logging.DEBUG)
    error_with_traceback(logger, GONE)
    [r] = seen.records
    assert (r.levelno, r.levelname, r.exc_info) == (logging.DEBUG, "DEBUG", None)
    assert r.getMessage() == GONE


def test_other_grpc_errors_stay_errors(grpc_log: Any) -> None:
    logger, seen = grpc_log(logging.INFO)
    error_with_traceback(logger, "Unexpected [ValueError] raised by servicer method [/x/Y]")
    [r] = seen.records
    assert r.levelno == logging.ERROR and r.exc_info is not None
