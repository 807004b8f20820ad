"""What the wire tests of the API share: a raw stub on the daemon's socket."""
from __future__ import annotations

from typing import Any

import grpc
import pytest

from kvkeeper.v1 import kvkeeper_pb2_grpc as pb_grpc


@pytest.fixture
async def stub(daemon: Any) -> Any:
    async with grpc.aio.insecure_channel(f"unix:{daemon.socket_path}") as ch:
        yield pb_grpc.KVKeeperStub(ch)
