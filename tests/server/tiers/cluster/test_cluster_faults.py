"""What each failure of a cluster call counts as, and which start-up failures
are configuration errors naming a key (the rest: a cluster that is only down)."""
from __future__ import annotations

import asyncio
import ssl

import pytest
from redis import exceptions as rex

from kvkeeper.server.tiers.cluster.client import fault_kind, startup_error
from kvkeeper.server.tiers.cluster.config import ClusterSettings, parse_cluster_url


@pytest.mark.parametrize("exc,kind", [
    (asyncio.TimeoutError(), "timeout"),
    (rex.TimeoutError("Timeout reading from socket"), "timeout"),
    (rex.ConnectionError("Error 111 connecting"), "connection"),
    (ConnectionRefusedError(), "connection"),
    (rex.RedisClusterException("Redis Cluster cannot be connected"), "connection"),
    (rex.AuthenticationError("invalid password"), "auth"),
    (rex.ResponseError("WRONGPASS invalid username-password pair"), "auth"),
    (rex.ResponseError("NOAUTH Authentication required."), "auth"),
    # What a cluster without a password to a node that wants one says (redis 8.1).
    (rex.RedisClusterException("Redis Cluster cannot be connected. Please provide at least one "
                               "reachable node: HELLO must be called with the client already "
                               "authenticated, otherwise the HELLO AUTH <user> <pass> option "
                               "can be used"), "auth"),
    (rex.BusyLoadingError("LOADING Redis is loading the dataset in memory"), "loading"),
    (rex.ClusterDownError("CLUSTERDOWN The cluster is down"), "cluster_down"),
    (rex.ResponseError("CLUSTERDOWN Hash slot not served"), "cluster_down"),
    (rex.ReadOnlyError("READONLY You can't write against a read only replica."), "readonly"),
    (rex.OutOfMemoryError("OOM command not allowed"), "oom"),
    (rex.ResponseError("OOM command not allowed when used memory > 'maxmemory'."), "oom"),
    (rex.ResponseError("ERR unknown command"), "response"),
    (ValueError("?"), "other"),
])
def test_fault_kinds(exc, kind):
    assert fault_kind(exc) == kind


def settings(url: str, **kw) -> ClusterSettings:
    return ClusterSettings(parse_cluster_url(url), **kw)


def caused_by(outer: Exception, inner: BaseException) -> Exception:
    outer.__cause__ = inner
    return outer


@pytest.mark.parametrize("url,exc,key", [
    ("redis://h:1", rex.AuthenticationError("invalid username-password pair"),
     "cluster_tier.password_file"),
    ("rediss://h:1", caused_by(rex.ConnectionError("Error connecting"), ssl.SSLCertVerificationError(
        1, "[SSL: CERTIFICATE_VERIFY_FAILED] certificate verify failed")), "cluster_tier.ca_file"),
    ("rediss://h:1", rex.ConnectionError("tlsv13 alert certificate required (_ssl.c:2580)"),
     "cluster_tier.cert_file"),
    ("rediss://h:1", rex.ConnectionError("[SSL: WRONG_VERSION_NUMBER] wrong version number"),
     "cluster_tier.url"),
    ("redis://h:1", rex.ConnectionError("Connection closed by server."), "cluster_tier.url"),
])
def test_configuration_errors_name_their_key(url, exc, key):
    err = startup_error(settings(url, password_file="/pw"), exc)
    assert err is not None and err.key == key


@pytest.mark.parametrize("exc", [rex.ConnectionError("Error 111 connecting to h:1."),
                                 asyncio.TimeoutError(), rex.ClusterDownError("down"),
                                 rex.BusyLoadingError("LOADING")])
def test_a_cluster_that_is_only_down_is_no_configuration_error(exc):
    assert startup_error(settings("redis://h:1"), exc) is None
    assert startup_error(settings("rediss://h:1"), exc) is None
