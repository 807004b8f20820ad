"""kv_connector_extra_config: every mistake is an error naming the key (pure Python)."""
from __future__ import annotations

import pytest

from kvkeeper.connector.config import KNOWN_KEYS, ConfigError, ConnectorConfig


def parse(**extra):
    return ConnectorConfig.from_extra({"kvkeeper_url": "unix:///s", **extra}, None, env={})


def test_an_unknown_key_names_it_and_every_known_key() -> None:
    with pytest.raises(ConfigError) as info:
        parse(kvkeeper_reconect_max_s=1, kvkeeper_zz=2)
    msg = str(info.value)
    assert "kvkeeper_reconect_max_s" in msg and "kvkeeper_zz" in msg
    for key in KNOWN_KEYS:
        assert key in msg
    # keys of other software (no kvkeeper_ prefix) are not ours to judge
    assert parse(other_connector_setting=1).url == "unix:///s"


@pytest.mark.parametrize("key,value", [
    ("kvkeeper_lookup_timeout_s", 0), ("kvkeeper_lookup_timeout_s", "fast"),
    ("kvkeeper_lookup_timeout_s", True), ("kvkeeper_io_timeout_s", float("nan")),
    ("kvkeeper_io_timeout_s", float("inf")), ("kvkeeper_lookup_wait_s", -0.1),
    ("kvkeeper_max_retries", -1), ("kvkeeper_max_retries", 1.5), ("kvkeeper_max_retries", [1]),
    ("kvkeeper_reconnect_min_s", 0), ("kvkeeper_reconnect_max_s", "x"),
    ("kvkeeper_transport", "rdma"), ("kvkeeper_transport", 1), ("kvkeeper_checksum", "md5"),
    ("kvkeeper_load_overlap", "maybe"), ("kvkeeper_max_pending_save_mib", 0),
    ("kvkeeper_recompute_on_load_failure", "sometimes"), ("kvkeeper_report", 2.5),
    ("kvkeeper_report", ""), ("kvkeeper_model_id", ""), ("kvkeeper_model_id", 7),
    ("kvkeeper_model_revision", "  "),
    ("kvkeeper_url", "http://h:1"), ("kvkeeper_url", "h"), ("kvkeeper_url", "h:99999"),
    ("kvkeeper_url", 5),
])
def test_a_bad_value_names_its_key(key: str, value: object) -> None:
    with pytest.raises(ConfigError, match=key):
        parse(**{key: value})


def test_missing_url_and_bad_role_and_bad_container() -> None:
    with pytest.raises(ConfigError, match="kvkeeper_url"):
        ConnectorConfig.from_extra({}, None, env={})
    with pytest.raises(ConfigError, match="kvkeeper_url"):   # a bad URL from the environment
        ConnectorConfig.from_extra({}, None, env={"KVKEEPER_URL": "http://x"})
    with pytest.raises(ConfigError, match="kv_role"):
        ConnectorConfig.from_extra({"kvkeeper_url": "h:1"}, "kv_sideways", env={})
    with pytest.raises(ConfigError, match="JSON object"):
        ConnectorConfig.from_extra(["kvkeeper_url"], None, env={})  # type: ignore[arg-type]


def test_good_values_in_the_forms_json_and_env_give_them() -> None:
    c = parse(kvkeeper_lookup_timeout_s="0.5", kvkeeper_max_retries="3", kvkeeper_report="yes",
              kvkeeper_recompute_on_load_failure=0, kvkeeper_model_id="org/m",
              kvkeeper_max_pending_save_mib=0.5)
    assert c.lookup_timeout_s == 0.5 and c.max_retries == 3 and c.report
    assert not c.recompute_on_load_failure and c.model_id == "org/m"
    assert c.max_pending_save_bytes == 1 << 19
    assert ConnectorConfig.from_extra({}, None, env={"KVKEEPER_URL": "h:1"}).url == "h:1"
    # the extra config wins over the environment
    assert ConnectorConfig.from_extra({"kvkeeper_url": "h:2"}, None,
                                      env={"KVKEEPER_URL": "h:1"}).url == "h:2"


def test_reconnect_defaults_are_short_and_a_high_min_lifts_the_max() -> None:
    c = parse()
    assert c.reconnect_min_s <= c.reconnect_max_s <= 0.5
    assert parse(kvkeeper_reconnect_min_s=3).reconnect_max_s == 3.0


def test_checksum_defaults_to_xxh3_and_crc32_and_none_stay() -> None:
    assert parse().checksum == "xxh3"
    assert [parse(kvkeeper_checksum=v).checksum for v in ("xxh3", "crc32", "none")] == \
        ["xxh3", "crc32", "none"]
    with pytest.raises(ConfigError, match="xxh3, crc32, none"):
        parse(kvkeeper_checksum="XXH3")


def test_the_token_comes_from_its_file_or_the_environment_and_never_shows(tmp_path) -> None:
    f = tmp_path / "token"
    f.write_text("  tenant-a-0123456789abcdef\n")
    c = parse(kvkeeper_token_file=str(f))
    assert c.token == "tenant-a-0123456789abcdef"
    assert "0123456789abcdef" not in repr(c)
    env = {"KVKEEPER_TOKEN": "from-env-0123456789"}
    assert ConnectorConfig.from_extra({"kvkeeper_url": "unix:///s"}, None, env=env).token == \
        "from-env-0123456789"
    # The file named in the config wins over the environment.
    assert ConnectorConfig.from_extra({"kvkeeper_url": "unix:///s",
                                       "kvkeeper_token_file": str(f)}, None,
                                      env=env).token == "tenant-a-0123456789abcdef"
    assert parse().token is None


def test_a_token_that_cannot_be_read_or_sent_is_an_error_that_does_not_quote_it(
        tmp_path) -> None:
    with pytest.raises(ConfigError, match="kvkeeper_token_file: cannot read") as e:
        parse(kvkeeper_token_file="a-token-put-where-the-path-goes")
    assert "a-token" not in str(e.value)
    bad = tmp_path / "bad"
    bad.write_text("secret part\nsecond line\n")
    with pytest.raises(ConfigError, match="kvkeeper_token_file: the token must be") as e:
        parse(kvkeeper_token_file=str(bad))
    assert "secret" not in str(e.value)
    with pytest.raises(ConfigError, match="KVKEEPER_TOKEN") as e:
        ConnectorConfig.from_extra({"kvkeeper_url": "unix:///s"}, None,
                                   env={"KVKEEPER_TOKEN": "hidden part"})
    assert "hidden" not in str(e.value)


def test_tls_settings(tmp_path) -> None:
    from kvkeeper.client.auth import TLS

    def parse(**extra):   # TLS needs a host:port daemon
        return ConnectorConfig.from_extra({"kvkeeper_url": "10.0.0.1:50051", **extra}, None,
                                          env={})

    pem = tmp_path / "x.pem"
    pem.write_text("-----BEGIN CERTIFICATE-----\n")
    assert parse().client_tls() is None
    assert parse(kvkeeper_tls=True).client_tls() is True
    assert parse(kvkeeper_tls_ca_file=str(pem)).client_tls() == TLS(ca_file=str(pem))
    assert parse(kvkeeper_tls_cert_file=str(pem), kvkeeper_tls_key_file=str(pem)).client_tls() \
        == TLS(cert_file=str(pem), key_file=str(pem))
    with pytest.raises(ConfigError, match="go together"):
        parse(kvkeeper_tls_cert_file=str(pem))
    with pytest.raises(ConfigError, match="kvkeeper_tls_ca_file: .* is not a readable file"):
        parse(kvkeeper_tls_ca_file=str(tmp_path / "missing.pem"))
    with pytest.raises(ConfigError, match="unix socket"):
        ConnectorConfig.from_extra({"kvkeeper_url": "unix:///s", "kvkeeper_tls": True}, None,
                                   env={})
