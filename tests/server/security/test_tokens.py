"""kvkeeper.server.security.tokens: the tokens file, its checks, and digest lookups."""
from __future__ import annotations

import os

import pytest

from kvkeeper.server.config import ConfigError, GiB
from kvkeeper.server.security.tokens import load_tokens, parse_tokens

TOKEN_A = "tenant-a-secret-0123456789"
TOKEN_OPS = "ops-secret-abcdefghijklmn"

GOOD = f"""
[tokens.tenant-a]
token = "{TOKEN_A}"
models = ["org/model-a", "org/model-b"]

[tokens.ops]
token = "{TOKEN_OPS}"
models = ["*"]
admin = true

[quotas]
"org/model-a" = "2GiB"
"*" = 1024
"""


def write(tmp_path, text: str) -> str:
    p = tmp_path / "tokens.toml"
    p.write_text(text)
    os.chmod(p, 0o600)
    return str(p)


def test_load_a_good_file(tmp_path) -> None:
    table = load_tokens(write(tmp_path, GOOD))
    a, ops = table.grants
    assert (a.name, a.admin, a.models) == ("tenant-a", False,
                                          frozenset({"org/model-a", "org/model-b"}))
    assert (ops.name, ops.admin, ops.models) == ("ops", True, None)
    assert a.allows_model("org/model-b") and not a.allows_model("org/model-c")
    assert ops.allows_model("anything")
    assert table.quotas == {"org/model-a": 2 * GiB, "*": 1024}


def test_find_matches_exactly_one_token(tmp_path) -> None:
    table = load_tokens(write(tmp_path, GOOD))
    assert table.find(TOKEN_A).name == "tenant-a"
    assert table.find(TOKEN_OPS).name == "ops"
    for wrong in (TOKEN_A[:-1], TOKEN_A + "x", "", TOKEN_A.upper()):
        assert table.find(wrong) is None


def test_only_digests_are_kept(tmp_path) -> None:
    table = load_tokens(write(tmp_path, GOOD))
    assert TOKEN_A not in repr(table)
    assert all(TOKEN_A.encode() not in vars(g).get("digest", b"") for g in table.grants)


@pytest.mark.parametrize("text, fragment", [
    ('[tokens.a]\ntoken = "short"\nmodels = ["m"]\n', "at least 16"),
    ('[tokens.a]\ntoken = "has a space in it somewhere"\nmodels = ["m"]\n', "without whitespace"),
    ('[tokens.a]\ntoken = "0123456789abcdef"\nmodels = []\n', "non-empty list"),
    ('[tokens.a]\ntoken = "0123456789abcdef"\nmodels = "m"\n', "non-empty list"),
    ('[tokens.a]\ntoken = "0123456789abcdef"\nmodels = ["m"]\nadmin = "yes"\n', "true or false"),
    ('[tokens.a]\ntoken = "0123456789abcdef"\nmodels = ["m"]\nquota = 1\n', "unknown key 'quota'"),
    ('[tokens.a]\ntoken = 12345678901234567\nmodels = ["m"]\n', "must be a string"),
    ('[tokens.a]\ntoken = "0123456789abcdef"\nmodels = ["m"]\n'
     '[tokens.b]\ntoken = "0123456789abcdef"\nmodels = ["n"]\n', "the same token"),
    ('[quotas]\nm = "lots"\n', "[quotas] 'm'"),
    ('[quota]\nm = 1\n', "unknown table 'quota'"),
    ('tokens = 3\n', "[tokens.NAME]"),
    ('[tokens.a\n', "not valid TOML"),
])
def test_mistakes_name_the_key_and_never_the_token(tmp_path, text, fragment) -> None:
    with pytest.raises(ConfigError) as info:
        load_tokens(write(tmp_path, text))
    msg = str(info.value)
    assert fragment in msg and "auth.tokens_file" in msg and info.value.key == "auth.tokens_file"
    assert "0123456789abcdef" not in msg and "has a space" not in msg


def test_missing_file(tmp_path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        load_tokens(str(tmp_path / "nope.toml"))


def test_a_readable_file_is_warned_about(tmp_path, caplog) -> None:
    path = write(tmp_path, GOOD)
    load_tokens(path)
    assert "chmod 600" not in caplog.text
    os.chmod(path, 0o644)
    load_tokens(path)
    assert "chmod 600" in caplog.text


def test_quotas_without_tokens() -> None:
    table = parse_tokens({"quotas": {"m": "1KiB"}})
    assert table.grants == () and table.quotas == {"m": 1024}


def test_a_tokens_file_that_is_not_utf8_is_a_config_error(tmp_path) -> None:
    p = tmp_path / "tokens.toml"
    p.write_bytes(f'[tokens.a]\ntoken = "{TOKEN_A}\xff"\nmodels = ["*"]\n'.encode("latin-1"))
    os.chmod(p, 0o600)
    with pytest.raises(ConfigError) as ei:
        load_tokens(str(p))
    assert ei.value.key == "auth.tokens_file" and "not UTF-8" in str(ei.value)
    assert TOKEN_A not in str(ei.value)      # no bytes of the file in the message
