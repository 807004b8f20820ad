"""Checks that involve more than one value, run once every source is read."""
from __future__ import annotations

from typing import Any

from ..tiers.cluster.config import ClusterConfigError, check_tls_keys, parse_cluster_url
from .parsers import parse_address, show_raw, show_size
from .schema import HOST_HEADER_BYTES, PAGE_ALIGN, Config, ConfigError


def _fail(c: Config, key: str, problem: str, value: Any) -> ConfigError:
    src = c.source_of(key)
    return ConfigError(f"{key} = {show_raw(value)} (from {src}): {problem}", key=key, source=src)


def validate(c: Config) -> None:
    """ConfigError for the first check that fails, naming each value's source."""
    ht = c.host_tier
    if ht.page_bytes % PAGE_ALIGN:
        raise _fail(c, "host_tier.page_bytes", f"{ht.page_bytes} B is not a multiple of "
                    f"{PAGE_ALIGN}; try {show_size(max(PAGE_ALIGN, ht.page_bytes // PAGE_ALIGN * PAGE_ALIGN))}",
                    ht.page_bytes)
    need = HOST_HEADER_BYTES + ht.page_bytes
    if ht.capacity_bytes < need:
        raise _fail(c, "host_tier.capacity_bytes",
                    f"capacity {ht.capacity_bytes} B is smaller than one page: it needs at least "
                    f"{need} B (a {HOST_HEADER_BYTES} B header plus one page of "
                    f"{ht.page_bytes} B, host_tier.page_bytes from {c.source_of('host_tier.page_bytes')})",
                    ht.capacity_bytes)
    if not c.listen.socket and not c.listen.tcp:
        raise ConfigError(
            "no listener enabled: listen.socket (from "
            f"{c.source_of('listen.socket')}) and listen.tcp (from {c.source_of('listen.tcp')}) are "
            "both empty; set at least one", key="listen", source=c.source_of("listen.tcp"))
    tls = c.tls
    if bool(tls.cert_file) != bool(tls.key_file):
        key = "tls.key_file" if tls.cert_file else "tls.cert_file"
        raise _fail(c, key, "tls.cert_file and tls.key_file go together: set both or neither",
                    getattr(tls, key.split(".")[1]))
    if tls.client_ca_file and not tls.cert_file:
        raise _fail(c, "tls.client_ca_file", "mutual TLS needs the listener's own certificate: "
                    "set tls.cert_file and tls.key_file too", tls.client_ca_file)
    if tls.cert_file and not c.listen.tcp:
        raise _fail(c, "tls.cert_file", "TLS applies to listen.tcp, which is disabled",
                    tls.cert_file)
    if c.listen.tcp and c.metrics.address and \
            parse_address(c.listen.tcp) == parse_address(c.metrics.address) and \
            parse_address(c.listen.tcp)[1] != 0:
        raise _fail(c, "metrics.address", f"the same address as listen.tcp (from "
                    f"{c.source_of('listen.tcp')}); pick another port", c.metrics.address)
    dt = c.disk_tier
    if dt.path and dt.shared_capacity_bytes and \
            not 0 < dt.capacity_bytes <= dt.shared_capacity_bytes:
        raise _fail(c, "disk_tier.shared_capacity_bytes",
                    "the directory's budget must hold this daemon's own share: set "
                    "disk_tier.capacity_bytes (from "
                    f"{c.source_of('disk_tier.capacity_bytes')}) to a size no larger than it",
                    dt.shared_capacity_bytes)
    ct = c.cluster_tier
    if ct.url:
        try:
            check_tls_keys(parse_cluster_url(ct.url).tls, ct.ca_file, ct.cert_file, ct.key_file)
        except ClusterConfigError as e:
            name = e.key.split(".", 1)[1]
            raise _fail(c, e.key, str(e), getattr(ct, name)) from None
