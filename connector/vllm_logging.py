"""kvkeeper's logs (connector and client) printed through vLLM's handler."""
from __future__ import annotations

import logging

__all__ = ["adopt_vllm_logging"]


def adopt_vllm_logging() -> None:
    """Print kvkeeper's logs through vLLM's handler, with its format and level,
    unless the application configured "kvkeeper" itself."""
    ours = logging.getLogger("kvkeeper")
    theirs = logging.getLogger("vllm")
    if ours.handlers or not theirs.handlers or logging.getLogger().handlers:
        return  # configured already, or vLLM's logging is off, or the app logs via root
    for h in theirs.handlers:
        ours.addHandler(h)
    if ours.level == logging.NOTSET:
        ours.setLevel(theirs.level)
