"""Scrubbing: re-reading every stored block to find the corrupt ones before a
reader does (`kvkeeper verify`)."""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from .errors import CorruptBlock, NotStored

ReadInto = Callable[[bytes, bytes, Any], None]   # DiskStore.read_into
Read = Callable[[bytes, bytes], bytes]           # DiskStore.read


@dataclass
class VerifyReport:
    checked: int = 0
    bytes: int = 0            # payload bytes checked
    corrupt: int = 0          # failed and quarantined
    missing: int = 0          # gone meanwhile (deleted by another daemon)
    seconds: float = 0.0


def verify_blocks(items: list[tuple[bytes, bytes, int]], read_into: ReadInto, read: Read,
                  progress: Callable[[int, int], None] | None = None) -> VerifyReport:
    """Read back every (ns, key, payload bytes) in `items` through the store's
    checked reads, which quarantine what fails; count what they found."""
    t0 = time.perf_counter()
    rep = VerifyReport()
    buf = bytearray(max((n for _, _, n in items), default=0))
    mv = memoryview(buf)
    for i, (ns, key, n) in enumerate(items):
        try:
            read_into(ns, key, mv[:n])
            rep.checked += 1
            rep.bytes += n
        except CorruptBlock:
            rep.corrupt += 1
        except NotStored:
            rep.missing += 1
        except ValueError:
            # Rewritten with another size since the snapshot: read it as it is now.
            try:
                rep.bytes += len(read(ns, key))
                rep.checked += 1
            except CorruptBlock:
                rep.corrupt += 1
            except NotStored:
                rep.missing += 1
        if progress is not None:
            progress(i + 1, len(items))
    rep.seconds = time.perf_counter() - t0
    return rep
