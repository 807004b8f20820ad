"""kvkeeper.server.cli: serve (through --print-config and error paths), status, bench, version."""
from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import tomllib
import types
from concurrent.futures import ThreadPoolExecutor
from importlib.metadata import version as dist_version

import grpc
import pytest
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

from kvkeeper.server import cli
from kvkeeper.server.cli import grpc_target, main
from kvkeeper.server.config import Config, GiB, KiB
from kvkeeper.v1 import kvkeeper_pb2 as pb2
from kvkeeper.v1 import kvkeeper_pb2_grpc as pb2_grpc

VERSION = dist_version("kvkeeper")


@pytest.fixture(autouse=True)
def clean_env(monkeypatch, tmp_path):
    for var in list(os.environ):
        if var.startswith("KVKEEPER_"):
            monkeypatch.delenv(var)
    monkeypatch.chdir(tmp_path)


def run(capsys, *argv):
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


# --------------------------------------------------------------------------- serve
def test_print_config_defaults(capsys, tmp_path):
    rc, out, err = run(capsys, "serve", "--print-config")
    assert (rc, err) == (0, "")
    d = tomllib.loads(out)
    assert d["listen"]["socket"] == str(tmp_path / "kvkeeper.sock")
    assert d["listen"]["socket_mode"] == 0o660
    assert d["host_tier"]["capacity_bytes"] == GiB
    assert d["ledger"]["eviction_policy"] == "s3fifo"


def test_print_config_precedence(capsys, tmp_path, monkeypatch):
    (tmp_path / "kv.toml").write_text(
        '[host_tier]\ncapacity_bytes = "2GiB"\npage_bytes = "16KiB"\n'
        '[listen]\ntcp = "0.0.0.0:6000"\n[ledger]\neviction_policy = "hits-lru"\n'
        '[server]\nlog_level = "debug"\n')
    monkeypatch.setenv("KVKEEPER_HOST_TIER_CAPACITY_BYTES", "4GiB")
    monkeypatch.setenv("KVKEEPER_LISTEN_TCP", "127.0.0.1:7000")
    monkeypatch.setenv("KVKEEPER_SERVER_LOG_LEVEL", "warning")
    rc, out, err = run(capsys, "serve", "--config", "kv.toml", "--capacity", "8G",
                       "--log-level", "error", "--socket", "run/kv.sock", "--metrics", "",
                       "--set", "host_tier.name=kv0", "--set", "ledger.key_bytes=16",
                       "--print-config")
    assert (rc, err) == (0, "")
    d = tomllib.loads(out)
    assert d["host_tier"]["capacity_bytes"] == 8 * GiB          # flag > env > file
    assert d["server"]["log_level"] == "error"                   # flag > env > file
    assert d["listen"]["tcp"] == "127.0.0.1:7000"                # env > file
    assert d["host_tier"]["page_bytes"] == 16 * KiB              # file > default
    assert d["ledger"]["eviction_policy"] == "hits-lru"
    assert d["listen"]["socket"] == str(tmp_path / "run" / "kv.sock")
    assert d["metrics"]["address"] == ""
    assert d["host_tier"]["name"] == "kv0"
    assert d["ledger"]["key_bytes"] == 16
    assert "# 8GiB; from flag --capacity" in out
    assert "from environment variable KVKEEPER_LISTEN_TCP" in out
    assert "from config file kv.toml" in out
    assert "from flag --set host_tier.name" in out


def test_dedicated_flag_beats_set(capsys):
    rc, out, _ = run(capsys, "serve", "--set", "listen.tcp=127.0.0.1:1", "--tcp",
                     "127.0.0.1:2", "--print-config", "json")
    assert rc == 0
    assert json.loads(out)["listen"]["tcp"] == "127.0.0.1:2"


def test_print_config_json(capsys, monkeypatch):
    monkeypatch.setenv("KVKEEPER_LEDGER_LEASE_TTL_SECONDS", "2m")
    rc, out, err = run(capsys, "serve", "--policy", "hits-lru", "--page-size", "128KiB",
                       "--print-config", "json")
    assert (rc, err) == (0, "")
    d = json.loads(out)
    assert d["ledger"] == {"eviction_policy": "hits-lru", "key_bytes": 32,
                           "max_keys_per_call": 4096, "lease_ttl_seconds": 120.0,
                           "reservation_timeout_seconds": 60.0, "event_buffer_keys": 1 << 18,
                           "max_sessions_per_identity": 4096, "traffic_file": "",
                           "traffic_requests": 100000}
    assert d["host_tier"]["page_bytes"] == 128 * KiB
    assert d["listen"]["socket_mode"] == "0660"


def test_kvkeeper_config_env(capsys, tmp_path, monkeypatch):
    (tmp_path / "env.toml").write_text('[host_tier]\nname = "from-env-file"\n')
    monkeypatch.setenv("KVKEEPER_CONFIG", str(tmp_path / "env.toml"))
    rc, out, _ = run(capsys, "serve", "--print-config", "json")
    assert rc == 0 and json.loads(out)["host_tier"]["name"] == "from-env-file"


def test_missing_config_file(capsys):
    rc, out, err = run(capsys, "serve", "--config", "missing.toml")
    assert rc == 2 and out == ""
    assert err == "kvkeeper: config error: config file missing.toml: no such file\n"


def test_missing_config_named_by_env(capsys, monkeypatch):
    monkeypatch.setenv("KVKEEPER_CONFIG", "nowhere.toml")
    rc, _, err = run(capsys, "serve", "--print-config")
    assert rc == 2
    assert "nowhere.toml (named by KVKEEPER_CONFIG): no such file" in err


@pytest.mark.parametrize("argv, fragments", [
    (["--capacity", "12QB"], ["host_tier.capacity_bytes", "(from flag --capacity)",
                              "unknown size unit 'QB'"]),
    (["--capacity", "64KiB"], ["(from flag --capacity)", "smaller than one page"]),
    (["--page-size", "5000"], ["host_tier.page_bytes", "(from flag --page-size)",
                               "not a multiple of 4096"]),
    (["--policy", "lfu"], ["ledger.eviction_policy", "(from flag --policy)", "'lfu'"]),
    (["--tcp", "nohost"], ["listen.tcp", "(from flag --tcp)", "host:port"]),
    (["--tcp", "", "--socket", ""], ["no listener enabled", "flag --tcp", "flag --socket"]),
    (["--set", "host_tier.nme=x"], ["unknown key 'nme'", "did you mean 'name'?",
                                    "flag --set host_tier.nme"]),
    (["--set", "oops"], ["--set expects SECTION.KEY=VALUE"]),
    (["--set", "hosttier.name=x"], ["unknown section 'hosttier'", "did you mean 'host_tier'?"]),
])
def test_serve_config_errors(capsys, argv, fragments):
    rc, out, err = run(capsys, "serve", *argv, "--print-config")
    assert rc == 2 and out == ""
    assert err.startswith("kvkeeper: config error: ")
    for f in fragments:
        assert f in err


def test_env_error_names_variable(capsys, monkeypatch):
    monkeypatch.setenv("KVKEEPER_LEDGER_LEASE_TTL_SECONDS", "soon")
    rc, _, err = run(capsys, "serve")
    assert rc == 2
    assert "ledger.lease_ttl_seconds" in err
    assert "(from environment variable KVKEEPER_LEDGER_LEASE_TTL_SECONDS)" in err


def test_serve_hands_config_to_process_run(monkeypatch, tmp_path):
    seen = []
    fake = types.ModuleType("kvkeeper.server.ops.process")
    fake.run = lambda config, reload: seen.append((config, reload)) or 7  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "kvkeeper.server.ops.process", fake)
    (tmp_path / "kv.toml").write_text('[server]\nlog_level = "info"\n')
    assert main(["serve", "--config", "kv.toml", "--capacity", "2GiB", "--tcp", ""]) == 7
    ((config, reload),) = seen
    assert isinstance(config, Config)
    assert config.host_tier.capacity_bytes == 2 * GiB
    assert config.listen.tcp == ""
    assert config.listen.socket == str(tmp_path / "kvkeeper.sock")
    # SIGHUP's reloader reads the file again, and the flags still win over it.
    (tmp_path / "kv.toml").write_text('[server]\nlog_level = "debug"\n'
                                      '[host_tier]\ncapacity_bytes = "4GiB"\n')
    again = reload()
    assert again.server.log_level == "debug"
    assert again.host_tier.capacity_bytes == 2 * GiB


def test_serve_help_documents_precedence(capsys):
    rc, out, _ = run(capsys, "serve", "--help")
    assert rc == 0
    assert "precedence" in out and "KVKEEPER_CONFIG" in out and "--capacity" in out


def test_usage_errors(capsys):
    rc, _, err = run(capsys)
    assert rc == 2 and "usage:" in err
    rc, _, err = run(capsys, "frobnicate")
    assert rc == 2 and "invalid choice" in err
    rc, _, err = run(capsys, "serve", "--print-config", "yaml")
    assert rc == 2


# --------------------------------------------------------------------------- version, bench
def test_version(capsys):
    assert run(capsys, "version") == (0, f"kvkeeper {VERSION}\n", "")
    assert run(capsys, "--version") == (0, f"kvkeeper {VERSION}\n", "")


def test_console_script_version():
    script = os.path.join(os.path.dirname(sys.executable), "kvkeeper")
    if not os.path.exists(script):
        pytest.skip(f"no console script at {script}; pip install -e .")
    proc = subprocess.run([script, "version"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout == f"kvkeeper {VERSION}\n"


def test_bench_forwards_arguments(monkeypatch):
    from kvkeeper.server import bench
    seen = []
    monkeypatch.setattr(bench, "main", lambda argv: seen.append(argv) or 3, raising=False)
    assert main(["bench", "--blocks", "10", "-v", "serve"]) == 3
    assert seen == [["--blocks", "10", "-v", "serve"]]


# --------------------------------------------------------------------------- status
@pytest.mark.parametrize("url, target", [
    ("unix:///abs/kv.sock", "unix:///abs/kv.sock"),
    ("unix://rel/kv.sock", "unix:///base/rel/kv.sock"),
    ("unix://./kvkeeper.sock", "unix:///base/kvkeeper.sock"),
    ("unix:kv.sock", "unix:///base/kv.sock"),
    ("./kv.sock", "unix:///base/kv.sock"),
    ("127.0.0.1:50051", "127.0.0.1:50051"),
    ("tcp://localhost:1", "localhost:1"),
    ("[::1]:50051", "[::1]:50051"),
])
def test_grpc_target(url, target):
    assert grpc_target(url, cwd="/base")[0] == target


@pytest.mark.parametrize("url", ["http://x:1", "localhost", "unix://"])
def test_status_bad_url(capsys, url):
    rc, out, err = run(capsys, "status", "--url", url)
    assert rc == 2 and out == "" and err.startswith("kvkeeper: --url")


def test_status_no_socket(capsys, tmp_path):
    rc, out, err = run(capsys, "status", "--url", "unix://nothing.sock")
    assert rc == 1 and out == ""
    assert err.startswith("kvkeeper: cannot reach the daemon at unix://nothing.sock")
    assert f"no socket at {tmp_path / 'nothing.sock'}" in err
    assert "kvkeeper serve" in err


def test_status_default_url_from_env(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVKEEPER_URL", f"unix://{tmp_path}/env.sock")
    rc, _, err = run(capsys, "status")
    assert rc == 1 and f"no socket at {tmp_path / 'env.sock'}" in err


def test_status_socket_nobody_listens(capsys, tmp_path):
    path = tmp_path / "dead.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.close()                       # the file stays, nobody listens
    rc, out, err = run(capsys, "status", "--url", f"unix://{path}", "--timeout", "2s")
    assert rc == 1 and out == ""
    assert "cannot reach the daemon" in err and "UNAVAILABLE" in err


def test_status_tcp_refused(capsys):
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    port = s.getsockname()[1]
    s.close()
    rc, _, err = run(capsys, "status", "--url", f"127.0.0.1:{port}", "--timeout", "2")
    assert rc == 1 and f"cannot reach the daemon at 127.0.0.1:{port}" in err


class FakeKVKeeper(pb2_grpc.KVKeeperServicer):
    def Stats(self, request, context):
        return pb2.StatsResponse(
            version="0.1.0", uptime_seconds=3725.0, sessions=2, leases=5, reservations=1,
            namespaces=1, lookups=10, lookup_keys=400, hit_blocks=100, eviction_policy="lru",
            hit_tokens=3200, lookup_blocks=200, lookup_tokens=6400, prompt_blocks=400,
            prompt_tokens=12900,
            tiers=[pb2.TierStats(tier=pb2.TIER_HOST, capacity_bytes=GiB,
                                 used_bytes=GiB // 4, pinned_bytes=64 * KiB,
                                 evictable_bytes=GiB // 4 - 64 * KiB, capacity_pages=16383,
                                 used_pages=4096, blocks=2048, pending_blocks=3,
                                 evictions=17, hit_blocks=100)])


@pytest.fixture
def fake_daemon(tmp_path):
    def start(with_health: bool = True) -> str:
        path = tmp_path / "kv.sock"
        server = grpc.server(ThreadPoolExecutor(max_workers=2))
        pb2_grpc.add_KVKeeperServicer_to_server(FakeKVKeeper(), server)
        if with_health:
            hs = health.HealthServicer()
            hs.set("", health_pb2.HealthCheckResponse.SERVING)
            health_pb2_grpc.add_HealthServicer_to_server(hs, server)
        server.add_insecure_port(f"unix://{path}")
        server.start()
        servers.append(server)
        return f"unix://{path}"
    servers: list = []
    yield start
    for s in servers:
        s.stop(None)


def test_status_table(capsys, fake_daemon):
    url = fake_daemon()
    rc, out, err = run(capsys, "status", "--url", url)
    assert (rc, err) == (0, "")
    assert f"kvkeeper daemon at {url}" in out
    for label, value in [("version", "0.1.0"), ("uptime", "1h 02m 05s"), ("health", "SERVING"),
                         ("sessions", "2"), ("leases", "5"), ("reservations", "1"),
                         ("namespaces", "1"), ("lookups", "10 (400 keys)"),
                         ("loaded", "100 blocks, 3200 tokens"),
                         ("hit rate", "50.0% of 6400 tokens asked beyond the engines' caches; "
                                      "24.8% of 12900 prompt tokens")]:
        assert any(line.split() == [*label.split(), *value.split()]
                   for line in out.splitlines()), (label, out)
    header = next(line for line in out.splitlines() if line.split()[:1] == ["tier"])
    assert header.split() == ["tier", "capacity", "used", "pinned", "evictable", "blocks",
                              "pending", "evictions"]
    row = next(line for line in out.splitlines() if line.split()[:1] == ["host"])
    assert row.split() == ["host", "1.0", "GiB", "256.0", "MiB", "(25%)", "64.0", "KiB",
                           "255.9", "MiB", "2048", "3", "17"]


def test_status_json(capsys, fake_daemon):
    url = fake_daemon(with_health=False)
    rc, out, _ = run(capsys, "status", "--url", url, "--json")
    assert rc == 0
    d = json.loads(out)
    assert d["health"] == "unknown (no health service)"
    assert d["hit_rate"] == 0.5 and d["prompt_hit_rate"] == 3200 / 12900
    assert (d["hit_tokens"], d["lookup_tokens"], d["prompt_tokens"]) == (3200, 6400, 12900)
    assert (d["sessions"], d["leases"], d["lookup_keys"], d["eviction_policy"]) == \
        (2, 5, 400, "lru")
    (tier,) = d["tiers"]
    assert tier["tier"] == "host" and tier["capacity_bytes"] == GiB
    assert (tier["blocks"], tier["pending_blocks"], tier["evictions"]) == (2048, 3, 17)


def test_status_relative_unix_url(capsys, fake_daemon):
    fake_daemon()
    rc, out, _ = run(capsys, "status", "--url", "unix://kv.sock", "--json")
    assert rc == 0 and json.loads(out)["health"] == "SERVING"


def test_hit_rate_without_lookups():
    d = cli.status_dict(pb2.StatsResponse(), "SERVING", "x:1")
    assert d["hit_rate"] is None and d["prompt_hit_rate"] is None
    assert "n/a" in cli.render_status(d)
