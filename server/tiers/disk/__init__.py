"""Disk tier: one file per block under a directory that several daemons may share.

One concept per module:

    errors      what an operation raises (TierError and its kinds)
    header      the block file's header format (byte for byte, FORMAT_VERSION)
    layout      where files live under the root; the LAYOUT file (fan-out depth)
    fileio      whole-buffer reads and writes at the payload offset
    durability  syncfs(2) or fsync, and network/FUSE mount detection
    recovery    start-up: tmp leftovers removed, index rebuilt from headers
    verify      re-reading every block to find corrupt ones
    pins        pin files: "this owner is using this block"
    gclock      the lease naming the one daemon that garbage-collects
    store       DiskStore, which puts them together

Importers use this package's names (`from kvkeeper.server.tiers.disk import
DiskStore`); the modules are its implementation.
"""
from __future__ import annotations

from .durability import is_remote_fs
from .errors import CorruptBlock, DiskFull, DiskIOError, NotStored, TierError
from .gclock import GcLock, LockHolder
from .header import (CHECKSUM_CRC32, CHECKSUM_XXH3_64, FORMAT_VERSION, HEADER_BYTES,
                     HEADER_FIELDS_BYTES, HEADER_STRUCT, MAGIC, MAX_KEY_BYTES, MIN_KEY_BYTES,
                     NS_BYTES, PAYLOAD_ALGOS, WRITE_ALGO, Header, check_ns_key, pack_header,
                     parse_header)
from .layout import BLOCK_SUFFIX, DEFAULT_FANOUT_LEVELS, TMP_SUFFIX, check_owner
from .recovery import RecoveryReport
from .store import DiskStore
from .verify import VerifyReport

__all__ = [
    "BLOCK_SUFFIX", "CHECKSUM_CRC32", "CHECKSUM_XXH3_64", "DEFAULT_FANOUT_LEVELS", "FORMAT_VERSION",
    "HEADER_BYTES", "HEADER_FIELDS_BYTES", "HEADER_STRUCT", "MAGIC", "MAX_KEY_BYTES",
    "MIN_KEY_BYTES", "NS_BYTES", "PAYLOAD_ALGOS", "TMP_SUFFIX", "WRITE_ALGO", "CorruptBlock",
    "DiskFull", "DiskIOError", "DiskStore", "GcLock", "Header", "LockHolder", "NotStored",
    "RecoveryReport", "TierError", "VerifyReport", "check_ns_key", "check_owner", "is_remote_fs",
    "pack_header", "parse_header",
]
