"""Pin files: "this owner is using this block, until then".

A daemon that leases a block writes a pin file, pins/.../<kh>.<owner>, whose
content is its expiry (wall-clock seconds of the writer; wall clocks, not
monotonic ones, since pins are compared across hosts). `DiskStore.
delete_if_unpinned` refuses while any other owner's pin is unexpired. A pin
taken before the evictor's check always protects the block; a pin racing with
it can only turn into a miss (NotStored), never wrong data. The GC-lock holder
sweeps expired pins of every owner.

This module does the file work and raises OSError; `DiskStore` checks the
arguments and turns OSErrors into DiskIOError.
"""
from __future__ import annotations

import os
from collections.abc import Callable

from .durability import DurableDirs
from .fileio import unlink_quiet
from .layout import Layout, subdirs


def pin_expiry(path: str) -> float | None:
    """A pin's expiry; +inf if unreadable garbage (pins are written by rename,
    so garbage means damage: keep protecting rather than guess); None if gone."""
    try:
        with open(path, "rb") as f:
            raw = f.read(64)
    except FileNotFoundError:
        return None
    except OSError:
        return float("inf")
    try:
        return float(raw.split()[0])
    except (ValueError, IndexError):
        return float("inf")


class Pins:
    """The pin files under one root. `new_tmp` names a fresh tmp file: a pin
    is written there and renamed into place, so a reader never sees half."""

    def __init__(self, layout: Layout, dirs: DurableDirs, new_tmp: Callable[[], str]) -> None:
        self.layout = layout
        self.dirs = dirs
        self.new_tmp = new_tmp

    def write(self, ns: bytes, key: bytes, owner: str, expires_at: float) -> None:
        """Write or refresh `owner`'s pin (ns, key, owner already checked)."""
        d = self.layout.pin_dir(ns, key)
        tmp = self.new_tmp()
        try:
            self.dirs.ensure(d, self.layout.pins_dir)
            with open(tmp, "x") as f:
                f.write(f"{expires_at:.3f}\n")
            os.replace(tmp, os.path.join(d, f"{key.hex()}.{owner}"))
        except OSError:
            unlink_quiet(tmp)
            raise

    def remove(self, ns: bytes, key: bytes, owner: str) -> None:
        unlink_quiet(os.path.join(self.layout.pin_dir(ns, key), f"{key.hex()}.{owner}"))

    def held_by_others(self, ns: bytes, key: bytes, owner: str, now: float) -> bool:
        """Whether an owner other than `owner` holds an unexpired pin on the block."""
        prefix = key.hex() + "."
        try:
            entries = list(os.scandir(self.layout.pin_dir(ns, key)))
        except FileNotFoundError:
            return False
        for e in entries:
            if not e.name.startswith(prefix) or e.name[len(prefix):] == owner:
                continue
            expires = pin_expiry(e.path)
            if expires is None:
                continue  # gone meanwhile
            if expires > now:
                return True
        return False

    def sweep(self, now: float) -> int:
        """Remove expired pins (of any owner); returns how many were removed."""
        removed = 0
        for ns_e in subdirs(self.layout.pins_dir, 16):
            for a in subdirs(ns_e.path, 2):
                with os.scandir(a.path) as it:
                    for e in it:
                        expires = pin_expiry(e.path)
                        if expires is not None and expires <= now:
                            unlink_quiet(e.path)
                            removed += 1
        return removed
