"""Daemon URLs: every accepted form maps to a gRPC target; typos fail early."""
import pytest

from kvkeeper.client.url import KeeperURL, parse_host_port, parse_url, to_grpc_target


@pytest.mark.parametrize("url, target, kind", [
    ("unix:///tmp/kvkeeper.sock", "unix:/tmp/kvkeeper.sock", "unix"),
    ("unix://run/kvkeeper.sock", "unix:run/kvkeeper.sock", "unix"),
    ("unix:kvkeeper.sock", "unix:kvkeeper.sock", "unix"),
    ("unix:/abs/kvkeeper.sock", "unix:/abs/kvkeeper.sock", "unix"),
    ("localhost:50051", "localhost:50051", "tcp"),
    ("127.0.0.1:1", "127.0.0.1:1", "tcp"),
    ("kv-keeper.svc.cluster.local:65535", "kv-keeper.svc.cluster.local:65535", "tcp"),
    ("[::1]:50051", "[::1]:50051", "tcp"),
    ("[fe80::1%eth0]:7", "[fe80::1%eth0]:7", "tcp"),
    ("dns:///keeper.example.com:443", "dns:///keeper.example.com:443", "tcp"),
    ("dns:///[::1]:443", "dns:///[::1]:443", "tcp"),
])
def test_valid(url, target, kind):
    parsed = parse_url(url)
    assert isinstance(parsed, KeeperURL)
    assert parsed.target == target == to_grpc_target(url)
    assert parsed.kind == kind


def test_fields():
    assert parse_url("unix://rel/x.sock").path == "rel/x.sock"
    assert parse_url("unix:///abs/x.sock").path == "/abs/x.sock"
    u = parse_url("[::1]:9")
    assert (u.host, u.port) == ("::1", 9)
    u = parse_url("dns:///h:10")
    assert (u.host, u.port) == ("h", 10)


@pytest.mark.parametrize("url, why", [
    ("", "empty"),
    (" localhost:1", "whitespace"),
    ("unix:", "missing socket path"),
    ("unix://", "missing socket path"),
    ("unix:///", "missing socket path"),
    ("localhost", "missing ':port'"),
    ("localhost:", "not a number"),
    ("localhost:http", "not a number"),
    ("localhost:0", "outside 1..65535"),
    ("localhost:65536", "outside 1..65535"),
    (":50051", "missing host"),
    ("::1:50051", "brackets"),
    ("[::1]", "missing ':port'"),
    ("[::1:5", "unclosed"),
    ("[nope]:5", "not an IPv6 address"),
    ("bad_host!:5", "not a valid host name"),
    ("http://localhost:1", "unsupported scheme"),
    ("grpc://localhost:1", "unsupported scheme"),
    ("dns://localhost:1", "dns:///host:port"),
    ("dns:localhost:1", "dns:///host:port"),
    ("dns:///localhost", "missing ':port'"),
])
def test_invalid(url, why):
    with pytest.raises(ValueError) as info:
        parse_url(url)
    msg = str(info.value)
    assert why in msg
    assert repr(url) in msg and "expected one of" in msg


def test_not_a_string():
    with pytest.raises(ValueError):
        parse_url(None)  # type: ignore[arg-type]


# The forms `kvkeeper status --url` always took, now the client's too: one KVKEEPER_URL.
@pytest.mark.parametrize("url, target, kind, path", [
    ("tcp://localhost:50051", "localhost:50051", "tcp", None),
    ("tcp://[::1]:7", "[::1]:7", "tcp", None),
    ("./kvkeeper.sock", "unix:./kvkeeper.sock", "unix", "./kvkeeper.sock"),
    ("/run/kvkeeper/kvkeeper.sock", "unix:/run/kvkeeper/kvkeeper.sock", "unix",
     "/run/kvkeeper/kvkeeper.sock"),
    ("rel/dir/kv.sock", "unix:rel/dir/kv.sock", "unix", "rel/dir/kv.sock"),
    ("unix://./kvkeeper.sock", "unix:./kvkeeper.sock", "unix", "./kvkeeper.sock"),
])
def test_cli_forms(url, target, kind, path):
    parsed = parse_url(url)
    assert (parsed.target, parsed.kind, parsed.path) == (target, kind, path)
    assert to_grpc_target(url) == target


def test_home_in_socket_path(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path))
    for url in ("unix://~/kv.sock", "~/kv.sock", "unix:~/kv.sock"):
        assert parse_url(url).path == f"{tmp_path}/kv.sock", url


@pytest.mark.parametrize("url, why", [
    ("tcp://", "missing ':port'"),
    ("tcp://localhost", "missing ':port'"),
    ("tcp://./kv.sock", "missing ':port'"),
    ("tcp://unix:/x", "not a number"),
    ("./dir/", "missing socket path"),
    ("kv.sock", "missing ':port'"),          # a path needs a '/', else it reads as a host
])
def test_cli_forms_invalid(url, why):
    with pytest.raises(ValueError) as info:
        parse_url(url)
    assert why in str(info.value) and "expected one of" in str(info.value)


# parse_host_port: the one host:port parser (URLs, listen.tcp, metrics.address).
@pytest.mark.parametrize("text, any_port, expected", [
    ("127.0.0.1:1", False, ("127.0.0.1", 1)),
    ("[::1]:65535", False, ("::1", 65535)),
    ("localhost:0", True, ("localhost", 0)),
    ("[::]:0", True, ("::", 0)),
])
def test_parse_host_port(text, any_port, expected):
    assert parse_host_port(text, any_port=any_port) == expected


@pytest.mark.parametrize("text, any_port, why", [
    ("localhost:0", False, "outside 1..65535"),
    ("localhost:65536", True, "outside 0..65535"),
    ("localhost", True, "missing ':port'"),
    (":1", True, "missing host"),
    ("::1:1", True, "brackets"),
    ("[::1:1", True, "unclosed"),
    ("bad host:1", True, "not a valid host name"),
])
def test_parse_host_port_refuses(text, any_port, why):
    with pytest.raises(ValueError, match=why):
        parse_host_port(text, any_port=any_port)
