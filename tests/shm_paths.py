"""Unique arena paths for the client's same-host tests (in /dev/shm where it exists)."""
from __future__ import annotations

import os
import uuid

SHM_DIR = "/dev/shm" if os.path.isdir("/dev/shm") else None


def unique_shm_path(base: str) -> str:
    return os.path.join(base, f"kvkeeper-test-{os.getpid()}-{uuid.uuid4().hex}")
