"""Block sizes and volumes shared by the byte-moving benchmarks (data, checksum).

Each measures the same block sizes, 256 KiB to 4 MiB (a KV block of a small
to a large model), over the same bytes per measurement: 256 MiB, more than
any last-level cache, as blocks come from the arena and not from cache
(32 MiB and one repetition with --quick, a smoke run).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import ClassVar

KiB, MiB = 1 << 10, 1 << 20
BLOCK_SIZES = (256 * KiB, 1 * MiB, 4 * MiB)


@dataclass(frozen=True)
class BlockScale:
    block_sizes: tuple[int, ...]
    move_bytes: int
    reps: int

    FULL_REPS: ClassVar[int] = 3   # repetitions of a full run; subclasses may ask for more

    @classmethod
    def for_mode(cls, quick: bool) -> "BlockScale":
        if quick:
            return cls(block_sizes=BLOCK_SIZES, move_bytes=32 * MiB, reps=1)
        return cls(block_sizes=BLOCK_SIZES, move_bytes=256 * MiB, reps=cls.FULL_REPS)


def size_label(n: int) -> str:
    """"256KiB", "4MiB": how result names spell a block size."""
    return f"{n // MiB}MiB" if n % MiB == 0 else f"{n // KiB}KiB"


__all__ = ["BLOCK_SIZES", "BlockScale", "KiB", "MiB", "size_label"]
