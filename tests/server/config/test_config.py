"""kvkeeper.server.config: value syntax, precedence, validation messages, rendering."""
from __future__ import annotations

import dataclasses
import json
import os
import tomllib

import pytest

from kvkeeper.server.config import (
    CLI_FLAGS, Config, ConfigError, GiB, HOST_HEADER_BYTES, KiB, MiB, TiB, describe_precedence,
    env_var, load_config, parse_address, parse_duration, parse_size, render_json, render_toml)
from kvkeeper.server.ids import HOST
from kvkeeper.server.ledger.ledger import Ledger


def write(tmp_path, text: str, name: str = "kv.toml") -> str:
    p = tmp_path / name
    p.write_text(text)
    return str(p)


def load(tmp_path, toml: str | None = None, env=None, overrides=None, **kw) -> Config:
    path = write(tmp_path, toml) if toml is not None else None
    return load_config(path, env or {}, overrides or {}, cwd=str(tmp_path), **kw)


def error(tmp_path, toml=None, env=None, overrides=None, **kw) -> str:
    with pytest.raises(ConfigError) as ei:
        load(tmp_path, toml, env, overrides, **kw)
    return str(ei.value)


# --------------------------------------------------------------------------- value syntax
@pytest.mark.parametrize("text, expected", [
    (65536, 65536), ("65536", 65536), ("64KiB", 64 * KiB), ("64kib", 64 * KiB),
    ("64K", 64 * KiB), ("64KB", 64 * KiB), ("512MiB", 512 * MiB), ("512M", 512 * MiB),
    ("1GiB", GiB), ("1G", GiB), ("1GB", GiB), ("2TiB", 2 * TiB), ("1.5GiB", 3 * GiB // 2),
    ("100B", 100), (" 8 GiB ", 8 * GiB), ("1_000", 1000), (4096.0, 4096),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("text, fragment", [
    ("12QB", "unknown size unit 'QB'"), ("GiB", "is not a size"), ("-1GiB", "is not a size"),
    ("0.3KiB", "not a whole number of bytes"), (True, "boolean"), ([1], "got array"),
    ("1.5", "not a whole number"),
])
def test_parse_size_rejects(text, fragment):
    with pytest.raises(ValueError) as ei:
        parse_size(text)
    assert fragment in str(ei.value)


@pytest.mark.parametrize("text, expected", [
    (30, 30.0), (0.5, 0.5), ("30", 30.0), ("30s", 30.0), ("2m", 120.0), ("1h", 3600.0),
    ("250ms", 0.25), ("1m30s", 90.0), ("1.5s", 1.5), ("2M", 120.0),
])
def test_parse_duration(text, expected):
    assert parse_duration(text) == pytest.approx(expected)


@pytest.mark.parametrize("text", ["", "s", "30x", "1m 30", "thirty", "-5s", "5s30"])
def test_parse_duration_rejects(text):
    with pytest.raises(ValueError, match="is not a duration"):
        parse_duration(text)


def test_parse_address():
    assert parse_address("127.0.0.1:50051") == ("127.0.0.1", 50051)
    assert parse_address("[::1]:80") == ("[::1]", 80)
    assert parse_address("localhost:0") == ("localhost", 0)
    for bad, fragment in [("localhost", "is not \"host:port\""), (":80", "is not \"host:port\""),
                          ("::1:80", "brackets"), ("h:99999", "outside 0..65535"),
                          ("h:abc", "is not a number"), ("[::1:80", "brackets")]:
        with pytest.raises(ValueError) as ei:
            parse_address(bad)
        assert fragment in str(ei.value), bad


# --------------------------------------------------------------------------- defaults
def test_defaults(tmp_path):
    c = load(tmp_path)
    assert c.listen.socket == str(tmp_path / "kvkeeper.sock")
    assert c.listen.tcp == "127.0.0.1:50051"
    assert c.listen.socket_mode == 0o660
    assert c.metrics.address == "127.0.0.1:9464"
    assert (c.host_tier.capacity_bytes, c.host_tier.page_bytes) == (GiB, 64 * KiB)
    assert (c.host_tier.shm_dir, c.host_tier.name) == ("/dev/shm", "")
    assert c.ledger == Config().ledger
    assert (c.ledger.eviction_policy, c.ledger.key_bytes, c.ledger.max_keys_per_call) == \
        ("s3fifo", 32, 4096)
    assert (c.ledger.lease_ttl_seconds, c.ledger.reservation_timeout_seconds) == (30.0, 60.0)
    assert (c.server.grace_seconds, c.server.max_message_bytes, c.server.log_level) == \
        (5.0, 64 * MiB, "info")
    assert c.source_of("host_tier.capacity_bytes") == "default"
    assert c.host_tier.segment_name(pid=42) == "kvkeeper-42"
    assert c.host_tier.segment_name() == f"kvkeeper-{os.getpid()}"


def test_config_is_frozen(tmp_path):
    c = load(tmp_path)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.listen.tcp = ""  # type: ignore[misc]
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.host_tier = None  # type: ignore[misc]


def test_disable_listeners_and_metrics(tmp_path):
    c = load(tmp_path, '[listen]\nsocket = ""\n[metrics]\naddress = ""\n')
    assert (c.listen.socket, c.listen.tcp, c.metrics.address) == ("", "127.0.0.1:50051", "")
    c = load(tmp_path, env={"KVKEEPER_LISTEN_TCP": ""})
    assert c.listen.tcp == "" and c.listen.socket


def test_socket_path_resolution(tmp_path):
    c = load(tmp_path, '[listen]\nsocket = "run/kv.sock"\n')
    assert c.listen.socket == str(tmp_path / "run" / "kv.sock")
    c = load(tmp_path, '[listen]\nsocket = "/abs/kv.sock"\n')
    assert c.listen.socket == "/abs/kv.sock"


@pytest.mark.parametrize("toml_value, expected", [
    ("0o600", 0o600), ('"0660"', 0o660), ('"640"', 0o640), ('"0o750"', 0o750), ("384", 0o600)])
def test_socket_mode(tmp_path, toml_value, expected):
    assert load(tmp_path, f"[listen]\nsocket_mode = {toml_value}\n").listen.socket_mode == expected


def test_socket_mode_decimal_pitfall(tmp_path):
    msg = error(tmp_path, "[listen]\nsocket_mode = 660\n")
    assert "listen.socket_mode" in msg and "0o660" in msg
    assert "not an octal mode" in error(tmp_path, env={"KVKEEPER_LISTEN_SOCKET_MODE": "0689"})


# --------------------------------------------------------------------------- precedence
TOML = """
[listen]
tcp = "0.0.0.0:6000"
socket = "file.sock"

[host_tier]
capacity_bytes = "2GiB"
page_bytes = "16KiB"
name = "from-file"

[ledger]
eviction_policy = "hits-lru"
lease_ttl_seconds = "45s"
key_bytes = 16

[server]
log_level = "debug"
"""


def test_precedence_file_env_flag(tmp_path):
    path = write(tmp_path, TOML)
    env = {
        "KVKEEPER_HOST_TIER_CAPACITY_BYTES": "4GiB",
        "KVKEEPER_LISTEN_TCP": "127.0.0.1:7000",
        "KVKEEPER_LEDGER_LEASE_TTL_SECONDS": "2m",
        "KVKEEPER_SERVER_LOG_LEVEL": "WARNING",
        "KVKEEPER_URL": "unix:///elsewhere",      # not a config key: ignored
        "UNRELATED": "x",
    }
    overrides = {"host_tier.capacity_bytes": "8G", "server.log_level": "error",
                 "metrics.address": None}          # None: flag not given
    c = load_config(path, env, overrides, cwd=str(tmp_path))
    # flag > env > file
    assert c.host_tier.capacity_bytes == 8 * GiB
    assert c.source_of("host_tier.capacity_bytes") == "flag --capacity"
    assert c.server.log_level == "error"
    # env > file
    assert c.listen.tcp == "127.0.0.1:7000"
    assert c.source_of("listen.tcp") == "environment variable KVKEEPER_LISTEN_TCP"
    assert c.ledger.lease_ttl_seconds == 120.0
    # file > default
    assert c.host_tier.page_bytes == 16 * KiB
    assert c.host_tier.name == "from-file"
    assert c.ledger.eviction_policy == "hits-lru"
    assert c.ledger.key_bytes == 16
    assert c.listen.socket == str(tmp_path / "file.sock")
    assert c.source_of("ledger.key_bytes") == f"config file {path}"
    # default
    assert c.metrics.address == "127.0.0.1:9464"
    assert c.source_of("metrics.address") == "default"


def test_env_without_file_and_typed_overrides(tmp_path):
    c = load(tmp_path, env={"KVKEEPER_LEDGER_KEY_BYTES": "64",
                            "KVKEEPER_LEDGER_MAX_KEYS_PER_CALL": " 100 ",
                            "KVKEEPER_SERVER_GRACE_SECONDS": "0"},
             overrides={"ledger.key_bytes": 48, "server.max_message_bytes": 8 * MiB})
    assert c.ledger.key_bytes == 48
    assert c.source_of("ledger.key_bytes") == "override ledger.key_bytes"
    assert c.ledger.max_keys_per_call == 100
    assert c.server.grace_seconds == 0.0
    assert c.server.max_message_bytes == 8 * MiB


def test_override_source_labels(tmp_path):
    msg = error(tmp_path, overrides={"host_tier.name": "a/b"},
                override_sources={"host_tier.name": "flag --set host_tier.name"})
    assert "host_tier.name" in msg and "(from flag --set host_tier.name)" in msg


def test_kvkeeper_config_env_names_the_file(tmp_path):
    path = write(tmp_path, '[host_tier]\nname = "via-env"\n')
    c = load_config(None, {"KVKEEPER_CONFIG": path}, {}, cwd=str(tmp_path))
    assert c.host_tier.name == "via-env"
    # an explicit path wins over KVKEEPER_CONFIG
    other = write(tmp_path, '[host_tier]\nname = "explicit"\n', "other.toml")
    c = load_config(other, {"KVKEEPER_CONFIG": path}, {}, cwd=str(tmp_path))
    assert c.host_tier.name == "explicit"
    with pytest.raises(ConfigError) as ei:
        load_config(None, {"KVKEEPER_CONFIG": str(tmp_path / "gone.toml")}, {})
    assert "gone.toml" in str(ei.value) and "named by KVKEEPER_CONFIG" in str(ei.value)
    assert "no such file" in str(ei.value)


# --------------------------------------------------------------------------- errors
def test_missing_file(tmp_path):
    with pytest.raises(ConfigError) as ei:
        load_config(str(tmp_path / "missing.toml"), {}, {})
    assert str(ei.value) == f"config file {tmp_path / 'missing.toml'}: no such file"


def test_invalid_toml(tmp_path):
    msg = error(tmp_path, "[listen\n")
    assert "not valid TOML" in msg and "kv.toml" in msg


def test_unknown_section_suggests(tmp_path):
    msg = error(tmp_path, '[host-tier]\ncapacity_bytes = "1GiB"\n')
    assert "unknown section 'host-tier'" in msg
    assert "did you mean 'host_tier'?" in msg
    assert "kv.toml" in msg


def test_top_level_key_points_at_its_section(tmp_path):
    msg = error(tmp_path, 'capacity_bytes = "1GiB"\n')
    assert "unknown section 'capacity_bytes'" in msg and "is a key of [host_tier]" in msg


def test_unknown_key_suggests(tmp_path):
    msg = error(tmp_path, '[host_tier]\ncapcity_bytes = "1GiB"\n')
    assert "unknown key 'capcity_bytes' in section [host_tier]" in msg
    assert "did you mean 'capacity_bytes'?" in msg
    msg = error(tmp_path, '[listen]\nlog_level = "info"\n')
    assert "'log_level' belongs to [server]" in msg


def test_unknown_env_key_suggests(tmp_path):
    msg = error(tmp_path, env={"KVKEEPER_HOST_TIER_CAPACITY": "1GiB"})
    assert "KVKEEPER_HOST_TIER_CAPACITY" in msg
    assert "did you mean 'KVKEEPER_HOST_TIER_CAPACITY_BYTES'?" in msg


def test_unknown_override_key(tmp_path):
    msg = error(tmp_path, overrides={"ledger.polcy": "lru"})
    assert "unknown key 'polcy' in section [ledger]" in msg


@pytest.mark.parametrize("toml, fragments", [
    ('[ledger]\nkey_bytes = "32"\n', ["ledger.key_bytes", "expected an integer, got string"]),
    ('[listen]\ntcp = 50051\n', ["listen.tcp", "expected a string, got integer"]),
    ('[ledger]\nlease_ttl_seconds = true\n', ["ledger.lease_ttl_seconds", "boolean"]),
    ('listen = 5\n', ["[listen]", "expected a table, got integer"]),
    ('[host_tier]\nname = {a = 1}\n', ["host_tier.name", "expected a value, got a table"]),
])
def test_wrong_type(tmp_path, toml, fragments):
    msg = error(tmp_path, toml)
    for f in fragments:
        assert f in msg
    assert "kv.toml" in msg


@pytest.mark.parametrize("env, fragments", [
    ({"KVKEEPER_LEDGER_KEY_BYTES": "4"}, ["ledger.key_bytes", "below the minimum 8"]),
    ({"KVKEEPER_LEDGER_KEY_BYTES": "thirty"}, ["'thirty' is not an integer"]),
    ({"KVKEEPER_LEDGER_MAX_KEYS_PER_CALL": "0"}, ["below the minimum 1"]),
    ({"KVKEEPER_LEDGER_LEASE_TTL_SECONDS": "0"}, ["must be greater than 0"]),
    ({"KVKEEPER_SERVER_MAX_MESSAGE_BYTES": "3GiB"}, ["above the maximum"]),
    ({"KVKEEPER_SERVER_MAX_MESSAGE_BYTES": "1KiB"}, ["below the minimum 64KiB"]),
    ({"KVKEEPER_HOST_TIER_PAGE_BYTES": "1KiB"}, ["below the minimum 4KiB"]),
])
def test_out_of_range_names_env_var(tmp_path, env, fragments):
    msg = error(tmp_path, env=env)
    (var,) = env
    assert f"(from environment variable {var})" in msg
    for f in fragments:
        assert f in msg


@pytest.mark.parametrize("value, fragment", [
    ("localhost", "is not \"host:port\""), ("::1:50051", "brackets"),
    ("127.0.0.1:70000", "outside 0..65535"), ("127.0.0.1:http", "is not a number"),
])
def test_bad_host_port(tmp_path, value, fragment):
    msg = error(tmp_path, overrides={"listen.tcp": value})
    assert msg.startswith(f'listen.tcp = "{value}" (from flag --tcp): ')
    assert fragment in msg
    msg = error(tmp_path, f'[metrics]\naddress = "{value}"\n')
    assert "metrics.address" in msg and fragment in msg


def test_metrics_and_grpc_on_one_port(tmp_path):
    msg = error(tmp_path, env={"KVKEEPER_METRICS_ADDRESS": "127.0.0.1:50051"})
    assert "metrics.address" in msg and "same address as listen.tcp" in msg


def test_no_listener(tmp_path):
    msg = error(tmp_path, '[listen]\nsocket = ""\n', env={"KVKEEPER_LISTEN_TCP": ""})
    assert "no listener enabled" in msg
    assert "kv.toml" in msg and "KVKEEPER_LISTEN_TCP" in msg


def test_capacity_smaller_than_one_page(tmp_path):
    msg = error(tmp_path, '[host_tier]\npage_bytes = "64KiB"\n',
                overrides={"host_tier.capacity_bytes": "64KiB"})
    assert "host_tier.capacity_bytes" in msg and "(from flag --capacity)" in msg
    assert "smaller than one page" in msg and str(64 * KiB + HOST_HEADER_BYTES) in msg
    # exactly header + one page is enough
    c = load(tmp_path, overrides={"host_tier.capacity_bytes": 68 * KiB})
    assert c.to_ledger_config().tiers[0].capacity_pages == 1


def test_page_not_multiple_of_4096(tmp_path):
    msg = error(tmp_path, env={"KVKEEPER_HOST_TIER_PAGE_BYTES": "6000"})
    assert "host_tier.page_bytes" in msg and "not a multiple of 4096" in msg
    assert "KVKEEPER_HOST_TIER_PAGE_BYTES" in msg


def test_unknown_policy(tmp_path):
    msg = error(tmp_path, '[ledger]\neviction_policy = "hits_lru"\n')
    assert "ledger.eviction_policy" in msg and "unknown value 'hits_lru'" in msg
    assert "did you mean 'hits-lru'?" in msg and "lru" in msg


def test_log_level_normalised(tmp_path):
    assert load(tmp_path, env={"KVKEEPER_SERVER_LOG_LEVEL": "WARN"}).server.log_level == "warning"
    assert "server.log_level" in error(tmp_path, overrides={"server.log_level": "loud"})


def test_bad_segment_name(tmp_path):
    msg = error(tmp_path, '[host_tier]\nname = "a/b"\n')
    assert "host_tier.name" in msg and "not a segment name" in msg


# --------------------------------------------------------------------------- derived
def test_to_ledger_config(tmp_path):
    c = load(tmp_path, TOML)
    lc = c.to_ledger_config()
    (spec,) = lc.tiers
    assert spec.name == HOST
    assert spec.capacity_bytes == 2 * GiB - HOST_HEADER_BYTES
    assert spec.page_bytes == 16 * KiB
    assert (lc.policy, lc.key_bytes, lc.max_keys_per_call) == ("hits-lru", 16, 4096)
    assert (lc.lease_ttl_s, lc.reservation_timeout_s) == (45.0, 60.0)
    ledger = Ledger(lc)
    assert ledger.top.capacity_pages == (2 * GiB - HOST_HEADER_BYTES) // (16 * KiB)


def test_as_dict_and_renderings_round_trip(tmp_path):
    c = load(tmp_path, TOML, env={"KVKEEPER_LISTEN_SOCKET_MODE": "0600"})
    d = c.as_dict()
    assert list(d) == ["listen", "metrics", "host_tier", "disk_tier", "ledger", "server",
                       "admin", "auth", "tls", "cluster_tier"]
    assert d["listen"]["socket_mode"] == 0o600
    assert d["host_tier"]["capacity_bytes"] == 2 * GiB
    text = render_toml(c)
    assert "from environment variable KVKEEPER_LISTEN_SOCKET_MODE" in text
    assert tomllib.loads(text)["listen"]["socket_mode"] == 0o600
    again = load_config(write(tmp_path, text, "printed.toml"), {}, {}, cwd="/")
    assert again == c
    j = json.loads(render_json(c))
    assert j["listen"]["socket_mode"] == "0600"
    again = load_config(write(tmp_path, _json_to_toml(j), "json.toml"), {}, {}, cwd="/")
    assert again == c


def _json_to_toml(d: dict) -> str:
    out = []
    for section, values in d.items():
        out.append(f"[{section}]")
        out += [f"{k} = {json.dumps(v)}" for k, v in values.items()]
    return "\n".join(out) + "\n"


def test_describe_precedence():
    text = describe_precedence()
    order = [text.index(s) for s in ("defaults", "TOML file", "environment", "flags")]
    assert order == sorted(order)
    assert "KVKEEPER_CONFIG" in text and "KVKEEPER_HOST_TIER_CAPACITY_BYTES" in text
    for flag in CLI_FLAGS.values():
        assert flag in text


def test_env_var_names():
    assert env_var("host_tier.capacity_bytes") == "KVKEEPER_HOST_TIER_CAPACITY_BYTES"
    assert env_var("listen.tcp") == "KVKEEPER_LISTEN_TCP"


# --------------------------------------------------------------------------- admin, auth, tls, logs
def test_security_and_log_defaults(tmp_path):
    c = load(tmp_path)
    assert c.admin.enabled is True
    assert (c.auth.tokens_file, c.auth.allow_insecure_tcp) == ("", False)
    assert (c.tls.cert_file, c.tls.key_file, c.tls.client_ca_file) == ("", "", "")
    assert (c.listen.socket_group, c.server.log_format) == ("", "text")
    assert c.server.eviction_storm_blocks == 10000


@pytest.mark.parametrize("text, expected", [("true", True), ("0", False), ("yes", True),
                                            ("Off", False)])
def test_booleans_from_the_environment(tmp_path, text, expected):
    assert load(tmp_path, env={"KVKEEPER_ADMIN_ENABLED": text}).admin.enabled is expected


def test_booleans_are_strict_in_the_file(tmp_path):
    assert "expected a boolean" in error(tmp_path, '[admin]\nenabled = "false"\n')
    assert "not a boolean" in error(tmp_path, env={"KVKEEPER_ADMIN_ENABLED": "maybe"})


def test_security_paths_resolve_against_the_working_directory(tmp_path):
    c = load(tmp_path, '[auth]\ntokens_file = "tokens.toml"\n'
                       '[tls]\ncert_file = "c.pem"\nkey_file = "/k.pem"\n')
    assert c.auth.tokens_file == str(tmp_path / "tokens.toml")
    assert (c.tls.cert_file, c.tls.key_file) == (str(tmp_path / "c.pem"), "/k.pem")


@pytest.mark.parametrize("toml, fragment", [
    ('[tls]\ncert_file = "c.pem"\n', "tls.key_file"),
    ('[tls]\nkey_file = "k.pem"\n', "tls.cert_file"),
    ('[tls]\nclient_ca_file = "ca.pem"\n', "needs the listener's own certificate"),
    ('[listen]\ntcp = ""\n[tls]\ncert_file = "c"\nkey_file = "k"\n', "listen.tcp, which is disabled"),
    ('[listen]\nsocket_group = "bad group"\n', "not a group name"),
    ('[server]\nlog_format = "xml"\n', "text, json"),
])
def test_security_and_log_mistakes(tmp_path, toml, fragment):
    assert fragment in error(tmp_path, toml)


def test_booleans_render_as_toml(tmp_path):
    c = load(tmp_path, '[admin]\nenabled = false\n[listen]\nsocket_group = "1000"\n')
    text = render_toml(c)
    assert "enabled = false" in text
    assert load_config(write(tmp_path, text, "printed.toml"), {}, {}, cwd="/") == c


def test_log_format_flag():
    assert CLI_FLAGS["server.log_format"] == "--log-format"


def test_a_shared_directory_budget_must_hold_this_daemons_own_share() -> None:
    ok = load_config(None, env={}, overrides={"disk_tier.path": "/d", "disk_tier.capacity_bytes":
                                              "1GiB", "disk_tier.shared_capacity_bytes": "4GiB"})
    assert ok.disk_tier.shared_capacity_bytes == 4 << 30
    for capacity in ("0", "8GiB"):     # 0: 90% of the filesystem, more than any budget
        with pytest.raises(ConfigError, match="disk_tier.shared_capacity_bytes") as e:
            load_config(None, env={}, overrides={"disk_tier.path": "/d",
                                                 "disk_tier.capacity_bytes": capacity,
                                                 "disk_tier.shared_capacity_bytes": "4GiB"})
        assert "disk_tier.capacity_bytes" in str(e.value)


def test_a_config_file_that_is_not_utf8_is_a_config_error(tmp_path):
    p = tmp_path / "kv.toml"
    p.write_bytes(b'[server]\nlog_level = "info" # caf\xe9 (latin-1)\n')
    with pytest.raises(ConfigError) as ei:
        load_config(str(p), {}, {})
    assert str(ei.value).startswith(f"config file {p}: not UTF-8 (byte 0xe9 at offset 33)")


def test_rendering_round_trips_characters_toml_escapes_differently_from_json(tmp_path):
    # Beyond U+FFFF: JSON's \ud83d\ude00 is no TOML escape; DEL: TOML wants it escaped.
    sock = str(tmp_path / "kv-\U0001F600-\u00e9-\x7f.sock")
    c = load(tmp_path, overrides={"listen.socket": sock})
    assert c.listen.socket == sock
    text = render_toml(c)
    assert "\U0001F600" in text and "\\u007f" in text
    assert load_config(write(tmp_path, text, "printed.toml"), {}, {}, cwd="/") == c
