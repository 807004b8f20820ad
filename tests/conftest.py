"""Shared fixtures: a real daemon on a temporary unix socket and TCP port 0."""
from __future__ import annotations

import os
import shutil
import tempfile
import uuid
from typing import Any, AsyncIterator

import pytest
from shm_paths import SHM_DIR, unique_shm_path

from kvkeeper.server.app import Daemon, create_server
from kvkeeper.server.config import Config, load_config

PAGE = 4096


def make_config(sockdir: str, **overrides: Any) -> Config:
    base = {
        "listen.socket": os.path.join(sockdir, "kvk.sock"),
        "listen.tcp": "127.0.0.1:0",
        "metrics.address": "",
        "host_tier.capacity_bytes": PAGE + 64 * PAGE,
        "host_tier.page_bytes": PAGE,
        "host_tier.name": f"kvkeeper-test-{uuid.uuid4().hex[:12]}",
        "server.grace_seconds": 1.0,
    }
    base.update(overrides)
    return load_config(None, env={}, overrides=base)


@pytest.fixture
def sockdir() -> Any:
    # Unix socket paths are limited to 108 bytes: keep them short.
    d = tempfile.mkdtemp(prefix="kvk-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture
async def daemon(sockdir: str) -> AsyncIterator[Daemon]:
    d, _ = create_server(make_config(sockdir))
    await d.start()
    try:
        yield d
    finally:
        await d.stop(0)


@pytest.fixture
async def daemon_factory(sockdir: str) -> AsyncIterator[Any]:
    """Start daemons with config overrides; all are stopped at teardown."""
    started: list[Daemon] = []

    async def start(**overrides: Any) -> Daemon:
        d, _ = create_server(make_config(tempfile.mkdtemp(prefix="kvk-", dir="/tmp"), **overrides))
        await d.start()
        started.append(d)
        return d

    yield start
    for d in started:
        await d.stop(0)


@pytest.fixture
def daemon_config(sockdir: str) -> Any:
    """make_config in a fresh socket directory, for tests that build a daemon themselves."""
    return lambda **overrides: make_config(sockdir, **overrides)


@pytest.fixture
def shm_path(tmp_path):
    """A unique arena path in /dev/shm (tmp_path where there is none), removed after the test."""
    path = unique_shm_path(SHM_DIR or str(tmp_path))
    yield path
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
