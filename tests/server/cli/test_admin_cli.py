"""kvkeeper.server.cli.admin: ls, inspect, evict, drain, verify against a real daemon,
with credentials, and their exit statuses."""
from __future__ import annotations

import asyncio
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

import pytest

from kvkeeper.client import AsyncClient, UnavailableError
from kvkeeper.server.cli import main

BLOCK = 4096
OPS = "ops-0123456789abcdefghij"
TENANT = "tenant-0123456789abcdef"


@pytest.fixture(autouse=True)
def clean_env(monkeypatch: Any) -> None:
    for var in list(os.environ):
        if var.startswith("KVKEEPER_"):
            monkeypatch.delenv(var)


def ns(model: str = "org/model-a") -> dict:
    return dict(model_id=model, dtype="bfloat16", kv_layout="NHD", block_tokens=16,
                block_bytes=BLOCK, tp_rank=1, tp_size=2)


def keys(n: int) -> list[bytes]:
    return [i.to_bytes(4, "little") * 8 for i in range(n)]


async def cli(capsys: Any, *argv: str) -> tuple[int, str, str]:
    rc = await asyncio.get_running_loop().run_in_executor(None, main, list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
async def client(daemon: Any) -> Any:
    c = await AsyncClient.connect(f"unix://{daemon.socket_path}", ns())
    await c.save(keys(3), [b"\x01" * BLOCK] * 3)
    yield c
    await c.close()


def url(d: Any) -> str:
    return f"unix://{d.socket_path}"


async def test_ls(capsys: Any, daemon: Any, client: Any) -> None:
    rc, out, err = await cli(capsys, "ls", "--url", url(daemon))
    assert (rc, err) == (0, "")
    head, row = out.splitlines()
    assert head.split()[:6] == ["namespace", "model", "dtype", "block", "tp", "sessions"]
    assert row.startswith(client.namespace_id.hex())
    assert "org/model-a" in row and "bfloat16" in row and "1/2" in row and "3 (12.0 KiB)" in row
    rc, out, _ = await cli(capsys, "ls", "--url", url(daemon), "--json")
    (item,) = json.loads(out)
    assert item["namespace_id"] == client.namespace_id.hex()
    assert (item["sessions"], item["quota_bytes"], item["cache_salted"]) == (1, None, False)
    assert item["tiers"] == [{"tier": "host", "blocks": 3, "bytes": 3 * BLOCK}]


async def test_ls_when_empty(capsys: Any, daemon: Any) -> None:
    rc, out, _ = await cli(capsys, "ls", "--url", url(daemon))
    assert rc == 0 and "no namespaces" in out


async def test_inspect(capsys: Any, daemon: Any, client: Any) -> None:
    nsid, key = client.namespace_id.hex(), keys(3)[1].hex()
    rc, out, err = await cli(capsys, "inspect", nsid, key, "--url", url(daemon))
    assert (rc, err) == (0, "")
    assert key in out and nsid in out and "committed" in out and "checksum xxh3_64 0x" in out
    rc, out, _ = await cli(capsys, "inspect", nsid, key, "--url", url(daemon), "--json")
    d = json.loads(out)
    assert [(c["tier"], c["state"], c["refs"]) for c in d["copies"]] == [("host", "committed", 0)]
    rc, _, err = await cli(capsys, "inspect", nsid, "ab" * 32, "--url", url(daemon))
    assert rc == 1 and "NOT_FOUND" in err
    rc, _, err = await cli(capsys, "inspect", "zz", key, "--url", url(daemon))
    assert rc == 2 and "not hex" in err
    rc, _, err = await cli(capsys, "inspect", "ab", key, "--url", url(daemon))
    assert rc == 2 and "32 hex digits" in err


async def test_evict(capsys: Any, daemon: Any, client: Any) -> None:
    m = await client.match(keys(1), lease=True)
    rc, out, _ = await cli(capsys, "evict", "--namespace", client.namespace_id.hex(),
                           "--url", url(daemon))
    assert rc == 0 and "evicted 2 blocks" in out and "1 stay" in out
    await client.release(m.lease_id)
    rc, out, _ = await cli(capsys, "evict", "--all", "--url", url(daemon), "--json")
    assert json.loads(out) == {"evicted": 1, "remaining": 0}
    rc, _, err = await cli(capsys, "evict", "--url", url(daemon))
    assert rc == 2 and "--namespace" in err
    rc, _, err = await cli(capsys, "evict", "--namespace", "00" * 16, "--url", url(daemon))
    assert rc == 1 and "unknown namespace" in err


async def test_drain(capsys: Any, daemon: Any, client: Any) -> None:
    rc, out, _ = await cli(capsys, "drain", "--url", url(daemon))
    assert rc == 0 and "refuses new saves" in out and "no disk tier" in out
    with pytest.raises(UnavailableError):
        await client.save(keys(5)[3:], [b"\x02" * BLOCK] * 2)
    rc, out, _ = await cli(capsys, "drain", "--url", url(daemon), "--json")
    assert json.loads(out)["draining"] is True


async def test_verify(capsys: Any, daemon_factory: Any) -> None:
    disk = tempfile.mkdtemp(prefix="kvk-disk-", dir="/tmp")
    try:
        d = await daemon_factory(**{"disk_tier.path": disk, "disk_tier.capacity_bytes": 1 << 24})
        c = await AsyncClient.connect(url(d), ns())
        await c.save(keys(4), [b"\x03" * BLOCK] * 4)
        rc, out, err = await cli(capsys, "verify", "--url", url(d))
        assert rc == 0 and "verified 4 blocks" in out and "0 bad" in out
        assert "verify: 4/4 blocks" in err
        with open(d.disk.store.block_path(c.namespace_id, keys(4)[0]), "r+b") as f:
            f.seek(-1, os.SEEK_END)
            f.write(b"\x00")
        rc, out, _ = await cli(capsys, "verify", "--url", url(d), "--json")
        assert rc == 1
        assert json.loads(out) | {"seconds": 0} == {"checked": 3, "bad": 1, "missing": 0,
                                                    "quarantined": 1, "bytes": 3 * BLOCK,
                                                    "seconds": 0}
        await c.close()
    finally:
        shutil.rmtree(disk, ignore_errors=True)


async def test_verify_without_disk_tier(capsys: Any, daemon: Any) -> None:
    rc, _, err = await cli(capsys, "verify", "--url", url(daemon))
    assert rc == 1 and "FAILED_PRECONDITION" in err and "no disk tier" in err


async def test_admin_disabled(capsys: Any, daemon_factory: Any) -> None:
    d = await daemon_factory(**{"admin.enabled": False})
    rc, _, err = await cli(capsys, "ls", "--url", url(d))
    assert rc == 1 and "does not serve the admin API" in err


async def test_no_daemon(capsys: Any, tmp_path: Path) -> None:
    rc, _, err = await cli(capsys, "ls", "--url", f"unix://{tmp_path}/none.sock")
    assert rc == 1 and "no socket" in err


async def test_tokens_from_a_file_or_the_environment(capsys: Any, daemon_factory: Any,
                                                     tmp_path: Path, monkeypatch: Any) -> None:
    tokens = tmp_path / "tokens.toml"
    tokens.write_text(f'[tokens.ops]\ntoken = "{OPS}"\nmodels = ["*"]\nadmin = true\n'
                      f'[tokens.t]\ntoken = "{TENANT}"\nmodels = ["m"]\n')
    d = await daemon_factory(**{"auth.tokens_file": str(tokens)})
    target = f"127.0.0.1:{d.port}"
    (tmp_path / "ops").write_text(OPS + "\n")
    (tmp_path / "tenant").write_text(TENANT)
    rc, out, err = await cli(capsys, "ls", "--url", target, "--token-file", str(tmp_path / "ops"))
    assert (rc, err) == (0, "")
    rc, _, err = await cli(capsys, "ls", "--url", target)
    assert rc == 1 and "UNAUTHENTICATED" in err
    rc, _, err = await cli(capsys, "ls", "--url", target, "--token-file", str(tmp_path / "tenant"))
    assert rc == 1 and "PERMISSION_DENIED" in err and TENANT not in err
    rc, _, err = await cli(capsys, "status", "--url", target)
    assert rc == 1 and "UNAUTHENTICATED" in err
    monkeypatch.setenv("KVKEEPER_TOKEN", TENANT)
    rc, out, _ = await cli(capsys, "status", "--url", target, "--json")
    assert rc == 0 and json.loads(out)["health"] == "SERVING"
    rc, _, err = await cli(capsys, "ls", "--url", target, "--token-file", str(tmp_path / "nope"))
    assert rc == 2 and "--token-file" in err


async def test_tls_is_for_tcp(capsys: Any, daemon: Any) -> None:
    rc, _, err = await cli(capsys, "ls", "--url", url(daemon), "--tls")
    assert rc == 2 and "TCP" in err
    rc, _, err = await cli(capsys, "ls", "--url", f"127.0.0.1:{daemon.port}", "--tls-cert", "x")
    assert rc == 2 and "--tls-key" in err
