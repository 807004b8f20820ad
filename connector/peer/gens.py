"""Block generations: how a peer knows the holder did not reuse a block under its copy.

One counter per vLLM block, in shared memory (client/peer_segment.py's
layout). The holder's scheduler bumps a block's counter when vLLM's block
pool hands the block out again (scheduler.py wraps BlockPool.get_new_blocks:
every block vLLM writes is first allocated there, before the step that
writes it reaches the worker), and the holder's worker publishes each block
it filled with the counter it read right after the forward that filled it.
So an entry (key, block, g) is true exactly while the counter still reads g.

A peer reads the counters of the blocks it is about to copy, copies, and
reads them again (copy_checked): a block whose counter moved at either
reading may have been overwritten while it was read, and it and every
block after it are not used (vLLM recomputes them). A bump happens before
the holder writes the block, so a copy that read any byte of the new
contents reads the moved counter afterwards (x86's loads are not reordered
with older loads; the copy is a plain memmove, then the counters are read).

The array lives in a file both processes of the holder's engine open by
name (gens_path: the workers create it at registration, before vLLM builds
its scheduler, which opens it next and removes the name); peers get it as a
read-only descriptor from the daemon.
"""
from __future__ import annotations

import hashlib
import mmap
import os
from typing import Callable, Sequence

import numpy as np

from kvkeeper.client.peer_segment import ATTACHED, attached_slot, gens_bytes

__all__ = ["Generations", "copy_checked", "first_changed", "gens_path"]

SHM_DIR = "/dev/shm"


def gens_path(engine_id: str, shm_dir: str = SHM_DIR) -> str:
    """The generation array's file of the engine `engine_id` (vLLM's
    kv_transfer_config.engine_id, the same in its scheduler and workers)."""
    digest = hashlib.sha256(engine_id.encode()).hexdigest()[:32]
    return os.path.join(shm_dir, f"kvkeeper-gens-{digest}")


class Generations:
    """A generation array over a shared mapping; `writable` for the holder."""

    def __init__(self, fd: int, num_blocks: int, writable: bool) -> None:
        if num_blocks <= 0:
            raise ValueError(f"num_blocks must be > 0, got {num_blocks}")
        size = gens_bytes(num_blocks)
        if os.fstat(fd).st_size < size:
            if not writable:
                raise ValueError(f"a generation array of {os.fstat(fd).st_size} bytes is too "
                                 f"small for {num_blocks} blocks")
            os.ftruncate(fd, size)
        prot = mmap.PROT_READ | (mmap.PROT_WRITE if writable else 0)
        self._mm = mmap.mmap(fd, size, flags=mmap.MAP_SHARED, prot=prot)
        self.array = np.frombuffer(self._mm, dtype=np.uint64)
        self.num_blocks = num_blocks

    @classmethod
    def open_named(cls, path: str, num_blocks: int) -> "tuple[Generations, int]":
        """Open (creating it if absent) the array at `path`, writable; and its
        descriptor, which the caller owns."""
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            return cls(fd, num_blocks, writable=True), fd
        except BaseException:
            os.close(fd)
            raise

    def bump(self, block_ids: Sequence[int]) -> None:
        """The blocks are about to hold something else: move their counters."""
        if len(block_ids):
            np.add.at(self.array, np.asarray(block_ids, dtype=np.int64), 1)

    def read(self, block_ids: Sequence[int]) -> np.ndarray:
        """The blocks' counters now (a copy)."""
        return self.array[np.asarray(block_ids, dtype=np.int64)]

    def attach(self) -> None:
        """Tell readers that every reuse is bumped from now on."""
        self.array[attached_slot(self.num_blocks)] = ATTACHED

    def detach(self) -> None:
        self.array[attached_slot(self.num_blocks)] = 0

    @property
    def attached(self) -> bool:
        return int(self.array[attached_slot(self.num_blocks)]) == ATTACHED

    def close(self) -> None:
        self.array = np.empty(0, dtype=np.uint64)
        try:
            self._mm.close()
        except BufferError:   # a view still exported: the mapping goes with it
            pass


def first_changed(now: Sequence[int], expected: Sequence[int]) -> int:
    """How many leading counters in `now` equal `expected`."""
    n = min(len(now), len(expected))
    if not n:
        return 0
    diff = np.flatnonzero(np.asarray(now[:n], dtype=np.uint64)
                          != np.asarray(expected[:n], dtype=np.uint64))
    return int(diff[0]) if diff.size else n


def copy_checked(gens: Generations, blocks: Sequence[int], expected: Sequence[int],
                 copy: Callable[[int], None]) -> int:
    """Copy the leading blocks whose generation is still `expected`, checked
    before and after: copy(k) copies blocks[:k]. Returns how many leading
    blocks are intact (their copies may be used)."""
    if not gens.attached:
        return 0
    k = first_changed(gens.read(blocks), expected)
    if k == 0:
        return 0
    copy(k)
    return first_changed(gens.read(blocks[:k]), expected[:k])
