"""The real servers the cluster tier's tests run against (tests/redis_servers.py),
and a key prefix of each test's own."""
import uuid

import pytest
from redis_servers import own_server, redis_cluster, redis_server  # noqa: F401 - fixtures


@pytest.fixture
def prefix() -> str:
    return f"t{uuid.uuid4().hex[:8]}:"
