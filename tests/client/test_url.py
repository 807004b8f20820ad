"""Daemon URLs: every accepted form maps to a gRPC target; typos fail early."""
import pytest

from kvkeeper.client.url import KeeperURL, parse_url, to_grpc_target


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
