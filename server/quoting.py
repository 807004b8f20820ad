"""Client-supplied values, quoted at a bounded length.

Every value a client sent that a status message or a log line repeats goes
through clip(): gRPC refuses status metadata above 16 KiB, so an unbounded
echo turns the documented answer into RESOURCE_EXHAUSTED, and a client could
inflate every log line it causes.
"""
from __future__ import annotations

from typing import Any

LIMIT = 64


def clip(value: Any, limit: int = LIMIT) -> str:
    """repr() of a str, the hex of bytes, str() of anything else; past `limit`
    characters cut, with the full length said: 'yyyy…' (20000 chars)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        raw = bytes(value)
        text, size, unit = raw.hex(), len(raw), "bytes"
    else:
        text = value if isinstance(value, str) else str(value)
        size, unit = len(text), "chars"
        text = repr(text) if isinstance(value, str) else text
    if len(text) <= limit:
        return text
    return f"{text[:limit]}… ({size} {unit})"


def cap(message: str, limit: int = 1024) -> str:
    """The last guard on a whole message: no answer may approach the metadata limit."""
    if len(message) <= limit:
        return message
    return message[:limit] + f"… (message cut at {limit} of {len(message)} chars)"
