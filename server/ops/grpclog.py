"""grpc's own log lines that any client can cause at will, at the level they deserve.

grpc.aio's server logs "ExecuteBatchError raised in core by servicer method
[...]" at ERROR, with a traceback, when it cannot send the answer of a call
whose client has just gone (its deadline passed, or it cancelled) before grpc
itself noticed: a race inside grpc, whatever the handler did. A client with
short deadlines gets one such line per call: an ERROR (and a page, where the
log is alerted on) that is no fault of the daemon. It is kept at DEBUG, without
the traceback. Found by tests/e2e/test_fuzz_stubs.py.
"""
from __future__ import annotations

import logging

GRPC_LOGGER = "grpc._cython.cygrpc"
CLIENT_GONE = "ExecuteBatchError raised in core by servicer method"


class ClientGone(logging.Filter):
    """Turns grpc's error for a call whose client left into a DEBUG line."""

    def filter(self, record: logging.LogRecord) -> bool:
        if record.levelno < logging.ERROR or not record.getMessage().startswith(CLIENT_GONE):
            return True
        record.levelno, record.levelname = logging.DEBUG, "DEBUG"
        record.exc_info = record.exc_text = None
        # The logger let it through as an ERROR: it is emitted only where DEBUG is.
        return logging.getLogger(record.name).isEnabledFor(logging.DEBUG)


_FILTER = ClientGone()


def install() -> None:
    """On grpc's server logger; idempotent (every daemon in a process shares the logger)."""
    logger = logging.getLogger(GRPC_LOGGER)
    if _FILTER not in logger.filters:
        logger.addFilter(_FILTER)
