"""deploy/docker's optional Valkey service (compose profile "cluster") and the
cluster tier's config example: the compose file parses, the service is only in
that profile, keeps no data and evicts on its own, nothing else depends on it,
and the example section loads with the image's config and names that service."""
from __future__ import annotations

import shutil
import subprocess

import pytest
from deploy_support import DEPLOY
from kvkeeper.server.config import load_config

yaml = pytest.importorskip("yaml")

DOCKER = DEPLOY / "docker"
COMPOSE = DOCKER / "compose.yaml"
IMAGE_CONFIG = DOCKER / "kvkeeper.toml"
EXAMPLE = DOCKER / "cluster_tier.example.toml"


def compose() -> dict:
    return yaml.safe_load(COMPOSE.read_text())


def flag(command: list[str], name: str) -> str:
    assert name in command, (name, command)
    return command[command.index(name) + 1]


def test_valkey_is_an_optional_service() -> None:
    services = compose()["services"]
    valkey = services["valkey"]
    assert valkey["profiles"] == ["cluster"]
    assert valkey["image"].startswith("valkey/valkey:")
    # Only the project's network reaches it (no published port), and without a
    # password it must accept the kvkeeper container's connections.
    assert "ports" not in valkey
    cmd = valkey["command"]
    assert cmd[0] == "valkey-server"
    assert flag(cmd, "--protected-mode") == "no"
    # The server decides what it keeps: a limit and an evicting policy, no persistence.
    assert flag(cmd, "--maxmemory").endswith(("gb", "mb"))
    assert flag(cmd, "--maxmemory-policy") in ("allkeys-lru", "allkeys-lfu")
    assert flag(cmd, "--save") == "" and flag(cmd, "--appendonly") == "no"
    assert valkey["healthcheck"]["test"][:2] == ["CMD", "valkey-cli"]
    # `docker compose up` without the profile must still work: nobody depends on it.
    for name, svc in services.items():
        assert "valkey" not in (svc.get("depends_on") or {}), name
        if name != "valkey":
            assert "profiles" not in svc, name


def test_kvkeeper_takes_the_cluster_url_from_the_environment() -> None:
    env = compose()["services"]["kvkeeper"]["environment"]
    # Empty by default (no cluster tier); the variable passes through when set.
    assert env["KVKEEPER_CLUSTER_TIER_URL"] == "${KVKEEPER_CLUSTER_TIER_URL:-}"
    off = load_config(str(IMAGE_CONFIG), env={"KVKEEPER_CLUSTER_TIER_URL": ""})
    assert off.cluster_tier.url == ""
    on = load_config(str(IMAGE_CONFIG), env={"KVKEEPER_CLUSTER_TIER_URL": "redis://valkey:6379"})
    assert on.cluster_tier.url == "redis://valkey:6379"


def test_config_example_loads_and_names_the_service(tmp_path) -> None:
    from kvkeeper.server.tiers.cluster.config import parse_cluster_url

    merged = tmp_path / "kvkeeper.toml"
    merged.write_text(IMAGE_CONFIG.read_text() + "\n" + EXAMPLE.read_text())
    cfg = load_config(str(merged), env={})
    ct = cfg.cluster_tier
    url = parse_cluster_url(ct.url)
    assert not url.cluster and not url.tls
    [(host, port)] = url.nodes
    assert host in compose()["services"] and port == 6379
    assert ct.write_policy == "write-back" and ct.timeout_seconds == 0.5
    assert ct.key_prefix and ct.max_keys_per_call >= 1


def test_example_is_refused_with_a_bad_value(tmp_path) -> None:
    """The example goes through the daemon's validation, not just a TOML parser."""
    from kvkeeper.server.config import ConfigError

    bad = tmp_path / "kvkeeper.toml"
    bad.write_text(IMAGE_CONFIG.read_text() + "\n"
                   + EXAMPLE.read_text().replace('"write-back"', '"write-sideways"'))
    with pytest.raises(ConfigError, match="cluster_tier.write_policy"):
        load_config(str(bad), env={})


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI")
def test_compose_config_with_the_cluster_profile() -> None:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("docker compose plugin not installed")
    r = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "--profile", "cluster",
                        "config", "--services"], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "valkey" in r.stdout.split()
