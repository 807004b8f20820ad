"""[cluster_tier]: the URL syntax, the key checks and their errors, the secret files."""
from __future__ import annotations

import pytest

from kvkeeper.server.config import ConfigError, load_config
from kvkeeper.server.tiers.cluster.config import (ClusterConfigError, ClusterSettings, ClusterUrl,
                                                  check_tls_files, parse_cluster_url,
                                                  read_password)


@pytest.mark.parametrize("url,want", [
    ("redis://10.0.0.1:7000", ClusterUrl(False, False, (("10.0.0.1", 7000),))),
    ("redis://cache", ClusterUrl(False, False, (("cache", 6379),))),
    ("rediss://cache:6380/3", ClusterUrl(False, True, (("cache", 6380),), 3)),
    ("redis+cluster://a:1,b:2,[::1]:3", ClusterUrl(True, False, (("a", 1), ("b", 2), ("::1", 3)))),
    ("rediss+cluster://a,[::1]", ClusterUrl(True, True, (("a", 6379), ("::1", 6379)))),
    ("REDIS://h:1", ClusterUrl(False, False, (("h", 1),))),
])
def test_urls(url, want):
    assert parse_cluster_url(url) == want
    assert parse_cluster_url(want.show()) == want


@pytest.mark.parametrize("url,says", [
    ("http://h:1", "not a cluster URL"),
    ("h:1", "not a cluster URL"),
    ("redis://user:pw@h:1", "no credentials"),
    ("redis://h:1,g:2", "names one server"),
    ("redis+cluster://h:1/2", "no database"),
    ("redis://h:1/x", "not a number"),
    ("redis://h:99999", "port"),
    ("redis+cluster://h:1,,g:2", "empty host"),
    ("redis://h:1?ssl=true", "no query"),
])
def test_bad_urls(url, says):
    with pytest.raises(ValueError, match=says):
        parse_cluster_url(url)


def load(**kw):
    return load_config(None, env={}, overrides={"listen.socket": "", **{
        f"cluster_tier.{k}": v for k, v in kw.items()}})


def test_the_section_loads_and_defaults_to_off():
    assert load().cluster_tier.url == ""
    c = load(url="redis+cluster://a:1,b:2", write_policy="write-back", timeout_seconds="250ms",
             max_keys_per_call=64, key_prefix="team1:kv/", password_file="pw")
    ct = c.cluster_tier
    assert (ct.write_policy, ct.timeout_seconds, ct.max_keys_per_call) == ("write-back", 0.25, 64)
    assert ct.password_file.endswith("/pw")   # resolved against the working directory


@pytest.mark.parametrize("kw,key", [
    ({"url": "redis://h:1,g:2"}, "cluster_tier.url"),
    ({"url": "redis://h:1", "key_prefix": "{tag}"}, "cluster_tier.key_prefix"),
    ({"url": "redis://h:1", "timeout_seconds": 0}, "cluster_tier.timeout_seconds"),
    ({"url": "redis://h:1", "max_keys_per_call": 0}, "cluster_tier.max_keys_per_call"),
    ({"url": "redis://h:1", "write_policy": "sometimes"}, "cluster_tier.write_policy"),
    ({"url": "redis://h:1", "ca_file": "/ca.pem"}, "cluster_tier.ca_file"),
    ({"url": "rediss://h:1", "cert_file": "/c.pem"}, "cluster_tier.key_file"),
    ({"url": "rediss://h:1", "key_file": "/c.key"}, "cluster_tier.cert_file"),
])
def test_bad_values_name_their_key(kw, key):
    with pytest.raises(ConfigError) as e:
        load(**kw)
    assert e.value.key == key and key in str(e.value)


def test_password_file(tmp_path):
    assert read_password("") is None
    p = tmp_path / "pw"
    p.write_text("s3cret\n")
    assert read_password(str(p)) == "s3cret"
    p.write_text("\n")
    with pytest.raises(ClusterConfigError, match="empty") as e:
        read_password(str(p))
    assert e.value.key == "cluster_tier.password_file"
    with pytest.raises(ClusterConfigError, match="cannot be read") as e:
        read_password(str(tmp_path / "missing"))
    assert e.value.key == "cluster_tier.password_file"


def test_unreadable_tls_files_name_their_key(tmp_path):
    ca = tmp_path / "ca.pem"
    ca.write_text("x")
    url = parse_cluster_url("rediss://h:1")
    check_tls_files(ClusterSettings(url, ca_file=str(ca)))
    with pytest.raises(ClusterConfigError) as e:
        check_tls_files(ClusterSettings(url, ca_file=str(ca), cert_file=str(tmp_path / "no.pem"),
                                        key_file=str(ca)))
    assert e.value.key == "cluster_tier.cert_file"
