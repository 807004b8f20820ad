"""The client's mapping of an arena each test module creates (`arena`, its
own size and page) at the root conftest's shm_path."""
from __future__ import annotations

import pytest

from kvkeeper.client.shm import ShmMapping


@pytest.fixture
def mapping(arena):
    m = ShmMapping.attach(arena.path, arena.size_bytes, arena.arena_id)
    assert m is not None
    yield m
    m.close()
