"""kvkeeper.server.security.auth: who a caller is, and which listeners may start without credentials."""
from __future__ import annotations

import logging

import pytest

from kvkeeper.server import errors
from kvkeeper.server.security.auth import (SOCKET_CALLER, AuthPolicy, bearer_token,
                                  check_exposure, is_loopback, server_credentials)
from kvkeeper.server.config import ConfigError, load_config
from kvkeeper.server.security.tokens import TokenTable, parse_tokens

TOKEN = "tenant-a-secret-0123456789"
TABLE = parse_tokens({"tokens": {
    "a": {"token": TOKEN, "models": ["m-a"]},
    "ops": {"token": "ops-secret-abcdefghijklmn", "models": ["*"], "admin": True}}})


def config(**overrides):
    base = {"listen.socket": "", "metrics.address": ""}
    base.update(overrides)
    return load_config(None, env={}, overrides=base)


@pytest.mark.parametrize("address, loopback", [
    ("127.0.0.1:1", True), ("127.1.2.3:1", True), ("[::1]:1", True), ("localhost:1", True),
    ("0.0.0.0:1", False), ("[::]:1", False), ("10.0.0.5:1", False), ("myhost:1", False)])
def test_is_loopback(address, loopback) -> None:
    assert is_loopback(address) is loopback


def test_loopback_tcp_needs_no_credentials() -> None:
    check_exposure(config(**{"listen.tcp": "127.0.0.1:0"}), None)


def test_non_loopback_tcp_without_credentials_is_a_config_error() -> None:
    with pytest.raises(ConfigError) as info:
        check_exposure(config(**{"listen.tcp": "0.0.0.0:0"}), None)
    assert info.value.key == "listen.tcp"
    msg = str(info.value)
    assert "auth.tokens_file" in msg and "tls.client_ca_file" in msg and "127.0.0.1" in msg
    with pytest.raises(ConfigError, match="defines no token"):
        check_exposure(config(**{"listen.tcp": "0.0.0.0:0"}), TokenTable())


def test_require_token_on_socket_needs_tokens() -> None:
    on = {"auth.require_token_on_socket": True}
    for table in (None, TokenTable()):
        with pytest.raises(ConfigError) as info:
            check_exposure(config(**on), table)
        assert info.value.key == "auth.require_token_on_socket"
    check_exposure(config(**on), TABLE)


def test_non_loopback_tcp_with_tokens_mtls_or_an_explicit_opt_out(caplog) -> None:
    with caplog.at_level(logging.WARNING):
        check_exposure(config(**{"listen.tcp": "0.0.0.0:0"}), TABLE)
    assert "clear text" in caplog.text
    check_exposure(config(**{"listen.tcp": "0.0.0.0:0", "tls.cert_file": "/c",
                             "tls.key_file": "/k", "tls.client_ca_file": "/ca"}), None)
    check_exposure(config(**{"listen.tcp": "0.0.0.0:0", "auth.allow_insecure_tcp": True}), None)
    with pytest.raises(ConfigError):  # TLS without client certificates authenticates nobody
        check_exposure(config(**{"listen.tcp": "0.0.0.0:0", "tls.cert_file": "/c",
                                 "tls.key_file": "/k"}), None)


def test_unreadable_tls_files_are_config_errors(tmp_path) -> None:
    assert server_credentials(config(**{"listen.tcp": "127.0.0.1:0"})) is None
    with pytest.raises(ConfigError) as info:
        server_credentials(config(**{"listen.tcp": "127.0.0.1:0",
                                     "tls.cert_file": str(tmp_path / "missing.pem"),
                                     "tls.key_file": str(tmp_path / "k.pem")}))
    assert info.value.key == "tls.cert_file"


@pytest.mark.parametrize("metadata, token", [
    ((), None), ((("x-other", "1"),), None), ((("authorization", f"Bearer {TOKEN}"),), TOKEN),
    ((("authorization", f"bearer  {TOKEN} "),), TOKEN),
    ((("authorization", f"Bearer {TOKEN}".encode()),), TOKEN)])
def test_bearer_token(metadata, token) -> None:
    assert bearer_token(metadata) == token


@pytest.mark.parametrize("value", ["Basic abc", "Bearer", "Bearer   ", TOKEN])
def test_malformed_authorization_is_unauthenticated(value) -> None:
    with pytest.raises(errors.Unauthenticated):
        bearer_token((("authorization", value),))


def test_identify_with_a_token_on_any_listener() -> None:
    policy = AuthPolicy(TABLE, mutual_tls=False)
    for peer in ("unix:/run/kvk.sock", "ipv4:10.0.0.1:5000"):
        caller = policy.identify(peer, None, TOKEN)
        assert (caller.name, caller.admin, caller.identity) == ("a", False, "token:a")
        assert caller.allows_model("m-a") and not caller.allows_model("m-b")
        with pytest.raises(errors.Unauthenticated, match="not valid"):
            policy.identify(peer, None, TOKEN + "x")


def test_identify_without_a_token() -> None:
    policy = AuthPolicy(TABLE, mutual_tls=False)
    assert policy.identify("unix:/run/kvk.sock", None, None) is SOCKET_CALLER
    with pytest.raises(errors.Unauthenticated, match="needs a bearer token"):
        policy.identify("ipv4:127.0.0.1:5000", None, None)
    with pytest.raises(errors.Unauthenticated):   # tokens defined: a certificate is not enough
        policy.identify("ipv4:127.0.0.1:5000", "CN=c1", None)
    no_tokens = AuthPolicy(TokenTable(), mutual_tls=True)
    assert no_tokens.identify("ipv6:[::1]:5000", "CN=c1", None).identity == "mtls:CN=c1"
    assert no_tokens.identify("ipv6:[::1]:5000", "CN=c2", None).identity == "mtls:CN=c2"
    with pytest.raises(errors.Unauthenticated):
        no_tokens.identify("ipv6:[::1]:5000", None, None)
    assert AuthPolicy(TokenTable(), mutual_tls=False).identify(
        "ipv4:127.0.0.1:1", None, None).identity == "tcp"


def test_require_token_on_socket() -> None:
    policy = AuthPolicy(TABLE, mutual_tls=False, require_token_on_socket=True)
    with pytest.raises(errors.Unauthenticated, match="needs a bearer token"):
        policy.identify("unix:/run/kvk.sock", None, None)
    assert policy.identify("unix:/run/kvk.sock", None, TOKEN).identity == "token:a"


class Context:
    def __init__(self, peer, metadata=()):
        self._peer, self._metadata = peer, metadata

    def peer(self):
        return self._peer

    def invocation_metadata(self):
        return self._metadata

    def auth_context(self):
        return {}


def test_check_namespace(caplog) -> None:
    policy = AuthPolicy(TABLE, mutual_tls=False)
    ctx = Context("ipv4:127.0.0.1:1", (("authorization", f"Bearer {TOKEN}"),))
    policy.check_namespace(ctx, "m-a")
    with pytest.raises(errors.PermissionDenied, match="'a' does not cover model 'm-b'"):
        policy.check_namespace(ctx, "m-b")
    policy.check_namespace(Context("unix:/x"), "m-b")
    assert TOKEN not in caplog.text
