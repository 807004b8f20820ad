"""kvkeeper.client.auth: the token's metadata and the channel's TLS."""
from __future__ import annotations

import grpc
import pytest

from kvkeeper.client import AsyncClient
from kvkeeper.client.auth import TLS, aio_channel, bearer_metadata, channel_credentials


def test_bearer_metadata() -> None:
    assert bearer_metadata(None) is None
    assert bearer_metadata("abc-123") == (("authorization", "Bearer abc-123"),)
    for bad in ("", " abc", "a b", "abc\n", 42):
        with pytest.raises(ValueError):
            bearer_metadata(bad)  # type: ignore[arg-type]


def test_tls_arguments(tmp_path) -> None:
    assert channel_credentials(None) is None and channel_credentials(False) is None
    assert isinstance(channel_credentials(True), grpc.ChannelCredentials)
    with pytest.raises(ValueError):
        TLS(cert_file="c.pem")
    with pytest.raises(OSError):
        channel_credentials(TLS(ca_file=str(tmp_path / "missing.pem")))
    with pytest.raises(ValueError):
        channel_credentials("yes")  # type: ignore[arg-type]


async def test_tls_is_refused_for_a_unix_socket() -> None:
    with pytest.raises(ValueError, match="TCP"):
        aio_channel("unix:/tmp/x.sock", True, [])
    with pytest.raises(ValueError, match="whitespace"):
        await AsyncClient.connect("unix:/tmp/none.sock", {"model_id": "m", "block_bytes": 1},
                                  token="two words")
