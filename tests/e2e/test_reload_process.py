"""SIGHUP on a `kvkeeper serve` process: the log level and the tokens file change
while a session goes on; a capacity change is refused and logged with its key."""
from __future__ import annotations

import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvkeeper.client import Client, KVKeeperClientError

from daemon_process import DaemonProcess, free_port, tokens_text, write_config

TOKEN_A = "reload-a-0123456789abcdef"
TOKEN_B = "reload-b-0123456789abcdef"
BLOCK = 4096
NS = dict(model_id="m", dtype="float16", block_tokens=16, block_bytes=BLOCK)


def keys(n: int) -> list[bytes]:
    return [i.to_bytes(4, "little") * 8 for i in range(n)]


@pytest.fixture
def workdir() -> Any:
    d = Path(tempfile.mkdtemp(prefix="kvk-hup-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_sighup_applies_safe_changes_and_refuses_a_capacity_change(workdir: Path) -> None:
    port = free_port()
    cfg = workdir / "kv.toml"
    settings = dict(sock=str(workdir / "kv.sock"), port=port,
                    name=f"kvkeeper-test-{uuid.uuid4().hex[:12]}")
    (workdir / "tokens1.toml").write_text(tokens_text(a=(TOKEN_A, ["m"])))
    (workdir / "tokens2.toml").write_text(tokens_text(a=(TOKEN_A, ["m"]), b=(TOKEN_B, ["m"])))
    write_config(cfg, tokens=str(workdir / "tokens1.toml"), **settings)
    d = DaemonProcess(cfg, workdir)
    a = None
    try:
        d.serving()
        url = f"127.0.0.1:{port}"
        a = Client.connect(url, NS, token=TOKEN_A, max_retries=0)
        sid = a.session_id
        a.save(keys(3), [b"\x05" * BLOCK] * 3)
        with pytest.raises(KVKeeperClientError) as info:
            Client.connect(url, NS, token=TOKEN_B, max_retries=0)
        assert info.value.code == grpc.StatusCode.UNAUTHENTICATED

        write_config(cfg, tokens=str(workdir / "tokens2.toml"), log_level="debug", **settings)
        d.hup()
        done = d.event("reload")
        assert sorted(done["applied"]) == ["auth.tokens_file", "server.log_level"]
        assert done["refused"] == []
        b = Client.connect(url, NS, token=TOKEN_B, max_retries=0)      # the new token
        b.close()
        assert a.match(keys(3)).matched == 3                           # the old session goes on
        assert a.session_id == sid

        write_config(cfg, tokens=str(workdir / "tokens2.toml"), log_level="debug",
                     capacity="2MiB", **settings)
        d.hup()
        refused = d.event("reload_refused")
        assert refused["key"] == "host_tier.capacity_bytes" and refused["level"] == "ERROR"
        assert "restart" in refused["msg"] and "host_tier.capacity_bytes" in refused["msg"]
        assert d.event("reload")["applied"] == []
        assert a.match(keys(3)).matched == 3

        # A broken tokens file is refused too, and the tokens in force stay.
        (workdir / "tokens2.toml").write_text("[tokens.b]\ntoken = 1\n")
        d.hup()
        d.wait_for(lambda r: r.get("event") == "reload_refused"
                   and r.get("key") == "auth.tokens_file", "refusing the tokens file")
        assert d.event("reload")["applied"] == []
        Client.connect(url, NS, token=TOKEN_B, max_retries=0).close()
        a.close()
        a = None
    finally:
        if a is not None:
            a.close()
        rc = d.stop()
    assert rc == 0, d.log
    assert TOKEN_A not in d.log and TOKEN_B not in d.log
