"""The client's mapping of an arena each test module creates (`arena`, its
own size and page) at the root conftest's shm_path; for the match lane's
tests, a socket path of their own and a clock they move."""
from __future__ import annotations

import os
import tempfile
from typing import Iterator

import pytest

from kvkeeper.client.shm import ShmMapping


@pytest.fixture
def mapping(arena):
    m = ShmMapping.attach(arena.path, arena.size_bytes, arena.arena_id)
    assert m is not None
    yield m
    m.close()


class Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def clock() -> Clock:
    return Clock()


@pytest.fixture
def path() -> Iterator[str]:
    """Where a scripted match lane listens (a short path: unix sockets' limit)."""
    d = tempfile.mkdtemp(prefix="lane-", dir="/tmp")
    yield os.path.join(d, "kvk.sock.match")
    for name in os.listdir(d):
        os.unlink(os.path.join(d, name))
    os.rmdir(d)
