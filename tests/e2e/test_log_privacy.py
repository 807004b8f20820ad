"""The daemon's log, as JSON lines at debug level, through a run with tokens,
keys, refusals and admin calls: structured, and free of token values and key bytes."""
from __future__ import annotations

import json
import shutil
import tempfile
import uuid
from pathlib import Path
from typing import Any

import grpc
import pytest

from kvkeeper.client import Client, KVKeeperClientError
from kvkeeper.v1 import admin_pb2 as apb
from kvkeeper.v1 import admin_pb2_grpc as apb_grpc

from daemon_process import DaemonProcess, free_port, tokens_text, write_config

TOKEN = "privacy-a-0123456789abcdef"
WRONG = "privacy-wrong-0123456789ab"
OPS = "privacy-ops-0123456789abcd"
BLOCK = 4096
NS = dict(model_id="m", dtype="float16", block_tokens=16, block_bytes=BLOCK)
KEYS = [bytes([0xC0 + i]) + b"\x9e\x51" * 15 + bytes([i]) for i in range(4)]


@pytest.fixture
def workdir() -> Any:
    d = Path(tempfile.mkdtemp(prefix="kvk-log-", dir="/tmp"))
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_json_log_has_no_tokens_and_no_keys(workdir: Path) -> None:
    port = free_port()
    tokens = workdir / "tokens.toml"
    tokens.write_text(tokens_text(a=(TOKEN, ["m"]), ops=(OPS, ["*"], True))
                      + '\n[quotas]\nm = "12KiB"\n')
    cfg = workdir / "kv.toml"
    write_config(cfg, sock=str(workdir / "kv.sock"), port=port, tokens=str(tokens),
                 name=f"kvkeeper-test-{uuid.uuid4().hex[:12]}", log_level="debug")
    d = DaemonProcess(cfg, workdir)
    url = f"127.0.0.1:{port}"
    try:
        d.serving()
        c = Client.connect(url, NS, token=TOKEN, max_retries=0)
        c.save(KEYS[:3], [b"\x07" * BLOCK] * 3)
        with pytest.raises(KVKeeperClientError):                      # over the quota
            c.save(KEYS[3:], [b"\x07" * BLOCK])
        m = c.match(KEYS, lease=True)
        assert c.load(m.lease_id) == [b"\x07" * BLOCK] * 3
        c.release(m.lease_id, discard_indices=[2])
        for bad in (WRONG, None):
            with pytest.raises(KVKeeperClientError):
                Client.connect(url, NS, token=bad, max_retries=0)
        with pytest.raises(KVKeeperClientError):                      # another model
            Client.connect(url, dict(NS, model_id="other"), token=TOKEN, max_retries=0)
        with grpc.insecure_channel(url) as ch:
            stub = apb_grpc.KVKeeperAdminStub(ch)
            md = (("authorization", f"Bearer {OPS}"),)
            stub.InspectBlock(apb.InspectBlockRequest(namespace_id=c.namespace_id,
                                                      key=KEYS[0]), metadata=md)
            with pytest.raises(grpc.RpcError):
                stub.InspectBlock(apb.InspectBlockRequest(namespace_id=c.namespace_id,
                                                          key=KEYS[3]), metadata=md)
            with pytest.raises(grpc.RpcError):
                stub.Evict(apb.EvictRequest(all=True),
                           metadata=(("authorization", f"Bearer {TOKEN}"),))
            stub.Evict(apb.EvictRequest(all=True), metadata=md)
        c.close()
    finally:
        rc = d.stop()
    assert rc == 0, d.log
    log = d.log
    records = [json.loads(line) for line in d.lines if line.startswith("{")]
    assert records and all({"ts", "level", "logger", "msg"} <= set(r) for r in records)
    events = {r.get("event") for r in records}
    assert {"auth_refused", "auth_denied", "admin_evict"} <= events
    assert any(r["msg"].startswith("session start") for r in records)
    for secret in (TOKEN, WRONG, OPS):
        assert secret not in log
    for k in KEYS:
        for form in (k.hex(), k.hex()[:16], k.hex().upper()[:16], repr(k)[2:-1][:16]):
            assert form not in log, form
