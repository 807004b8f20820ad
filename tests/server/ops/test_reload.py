"""kvkeeper.server.ops.reload: which changes a SIGHUP applies and which it refuses."""
from __future__ import annotations

from kvkeeper.server.config import load_config
from kvkeeper.server.ops.reload import SAFE_KEYS, plan_reload


def config(**overrides):
    base = {"listen.socket": "/tmp/kvk-reload.sock", "metrics.address": ""}
    base.update(overrides)
    return load_config(None, env={}, overrides=base)


def test_nothing_changed() -> None:
    plan = plan_reload(config(), config())
    assert (plan.applied, plan.refused) == ([], [])


def test_safe_keys_apply_and_unsafe_ones_are_refused_by_name() -> None:
    old = config(**{"auth.tokens_file": "/etc/a.toml"})
    new = config(**{"auth.tokens_file": "/etc/b.toml", "server.log_level": "debug",
                    "server.log_format": "json", "host_tier.capacity_bytes": "2GiB",
                    "listen.tcp": "127.0.0.1:7000", "ledger.eviction_policy": "hits-lru",
                    "admin.enabled": "false"})
    plan = plan_reload(old, new)
    assert sorted(plan.applied) == ["auth.tokens_file", "server.log_format", "server.log_level"]
    refused = dict(plan.refused)
    assert sorted(refused) == ["admin.enabled", "host_tier.capacity_bytes",
                               "ledger.eviction_policy", "listen.tcp"]
    assert "restart" in refused["host_tier.capacity_bytes"]
    assert "2147483648" in refused["host_tier.capacity_bytes"]
    c = plan.config
    assert (c.server.log_level, c.server.log_format, c.auth.tokens_file) == \
        ("debug", "json", "/etc/b.toml")
    assert c.host_tier == old.host_tier and c.listen == old.listen and c.admin == old.admin
    assert c.source_of("server.log_level") == "flag --log-level"
    assert c.source_of("host_tier.capacity_bytes") == "default"


def test_turning_tokens_on_or_off_needs_a_restart() -> None:
    on = plan_reload(config(), config(**{"auth.tokens_file": "/etc/a.toml"}))
    off = plan_reload(config(**{"auth.tokens_file": "/etc/a.toml"}), config())
    for plan in (on, off):
        assert plan.applied == [] and [k for k, _ in plan.refused] == ["auth.tokens_file"]
    assert on.config.auth.tokens_file == "" and off.config.auth.tokens_file == "/etc/a.toml"


def test_every_safe_key_exists() -> None:
    keys = {f"{s}.{k}" for s, ks in config().as_dict().items() for k in ks}
    assert SAFE_KEYS <= keys
