"""The connector's settings, read from kv_transfer_config.kv_connector_extra_config.

    --kv-transfer-config '{"kv_connector": "KVKeeperConnector",
                           "kv_connector_module_path": "kvkeeper.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvkeeper_url": "unix:///run/kvkeeper/kvkeeper.sock"}}'

| key | default | meaning |
|---|---|---|
| kvkeeper_url | $KVKEEPER_URL | the daemon: unix:///path, unix:path, host:port |
| kvkeeper_lookup_timeout_s | 1.0 | deadline of a scheduler lookup (Match); a slower daemon is a miss |
| kvkeeper_lookup_wait_s | 0.005 | longest wait for lookup answers per scheduling step, all requests together; a request still unanswered is skipped and asked again next step (0: never wait). While no request runs (a skipped step would run nothing) a lookup is waited for up to 50 ms instead |
| kvkeeper_io_timeout_s | 5.0 | deadline of each load / save RPC |
| kvkeeper_max_retries | 1 | retries of an idempotent RPC on UNAVAILABLE |
| kvkeeper_reconnect_min_s / _max_s | 0.1 / 0.5 | after a failure, the daemon is probed at this interval (doubling from min to max) until it answers; meanwhile lookups are misses and saves are dropped |
| kvkeeper_transport | auto | auto (shared memory on the daemon's host, else streaming), shm, stream |
| kvkeeper_checksum | xxh3 | what saves send: xxh3 (XXH3-64, memory speed), crc32 or none; loads check every block with the algorithm it was stored with (none: loads are not checked) |
| kvkeeper_model_id / kvkeeper_model_revision | from the model's files | override the namespace's model identity (see model_identity.py) |
| kvkeeper_load_overlap | auto | where loaded blocks are copied in and checked. on: on a connector thread on the cores vLLM's CPU backend leaves to the rest of the engine, layer by layer beside the forward; off: before the forward, in vLLM's thread; auto: on with at least 2 such cores; with 1 (which the engine core's busy polling shares: "on" measured slower there) before the forward, the connector thread doing half of it beside vLLM's thread |
| kvkeeper_max_pending_save_mib | 256 | copied-out blocks waiting to be sent; beyond, saves are dropped |
| kvkeeper_recompute_on_load_failure | true | set vLLM's kv_load_failure_policy to "recompute" (a cache miss must not fail a request) |
| kvkeeper_report | false | add {"kvkeeper": {...}} (hit tokens, saved blocks, namespace) to each request's kv_transfer_params |
| kvkeeper_report_residency | true | report what vLLM's own KV cache holds to the daemon (residency.py: Locate, WatchEvents, Match's gpu tier) |
| kvkeeper_peer | false | share this engine's KV cache with same-host engines of the same namespace, and load a prefix from theirs (connector/peer/; CPU build, TP 1, daemon on a unix socket; moves the KV cache into /dev/shm) |
| kvkeeper_token_file | $KVKEEPER_TOKEN | a file holding the bearer token this engine presents (daemons with auth.tokens_file); else the token itself from $KVKEEPER_TOKEN; else none |
| kvkeeper_tls | false | TLS to a host:port daemon, trusting the system's roots |
| kvkeeper_tls_ca_file / _cert_file / _key_file | none | TLS with these PEM files: the CA that signed the daemon's certificate, and this engine's certificate and key for mutual TLS (cert and key go together); any of them turns TLS on |

kv_role picks the directions: kv_producer saves only, kv_consumer loads only,
kv_both does both.

A setting that is wrong (an unknown kvkeeper_* key, a value of the wrong
type or out of range, a URL that cannot name a daemon) is ConfigError, which
the connector lets stop vLLM at start-up: a typo must not turn the cache off
silently. A daemon that cannot be reached is not a configuration error.
"""
from __future__ import annotations

import math
import os
from dataclasses import dataclass, field
from typing import Any, Callable, Dict, Mapping, Optional, Tuple

from kvkeeper.client.auth import TLS, TLSLike, bearer_metadata
from kvkeeper.client.checksum import DEFAULT as DEFAULT_CHECKSUM, NAMES as CHECKSUM_NAMES
from kvkeeper.client.url import parse_url

__all__ = ["ConnectorConfig", "ConfigError", "KNOWN_KEYS"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off"}
_ROLES = ("kv_both", "kv_producer", "kv_consumer")


class ConfigError(ValueError):
    """kv_connector_extra_config is invalid; the message names the key."""


def _bool(v: Any) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower() if isinstance(v, (str, int)) else None
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"must be a boolean (true/false), got {v!r}")


def _number(v: Any) -> float:
    if isinstance(v, bool):   # float(True) is 1.0: a bool here is a mistake
        raise ValueError(f"must be a number, got {v!r}")
    try:
        f = float(v)
    except (TypeError, ValueError):
        raise ValueError(f"must be a number, got {v!r}") from None
    if not math.isfinite(f):
        raise ValueError(f"must be a finite number, got {v!r}")
    return f


def _nonneg(v: Any) -> float:
    f = _number(v)
    if f < 0:
        raise ValueError(f"must be >= 0, got {v!r}")
    return f


def _pos(v: Any) -> float:
    f = _number(v)
    if f <= 0:
        raise ValueError(f"must be > 0, got {v!r}")
    return f


def _count(v: Any) -> int:
    f = _nonneg(v)
    if f != int(f):
        raise ValueError(f"must be a whole number, got {v!r}")
    return int(f)


def _choice(*options: str) -> Callable[[Any], str]:
    def parse(v: Any) -> str:
        if not isinstance(v, str) or v not in options:
            raise ValueError(f"must be one of {', '.join(options)}, got {v!r}")
        return v
    return parse


def _text(v: Any) -> str:
    if not isinstance(v, str) or not v.strip():
        raise ValueError(f"must be a non-empty string, got {v!r}")
    return v


def _url(v: Any) -> str:
    if not isinstance(v, str):
        raise ValueError(f"must be a string, got {v!r}")
    parse_url(v)   # ValueError listing the accepted forms
    return v


def _token(v: Any) -> str:
    """A bearer token; the message never quotes it."""
    try:
        bearer_metadata(v)
    except ValueError:
        raise ValueError("the token must be one non-empty line without whitespace") from None
    return str(v)


def _token_file(v: Any) -> str:
    """The token the file at path `v` holds (one line; surrounding whitespace ignored)."""
    path = _text(v)
    try:
        with open(path, encoding="utf-8") as fh:
            token = fh.read().strip()
    except (OSError, UnicodeDecodeError) as e:
        # Not the path: someone may have put the token itself where the path goes.
        why = e.strerror if isinstance(e, OSError) and e.strerror else type(e).__name__
        raise ValueError(f"cannot read the file it names: {why}") from None
    return _token(token)


def _pem_file(v: Any) -> str:
    path = _text(v)
    if not os.access(path, os.R_OK):
        raise ValueError(f"{path!r} is not a readable file")
    return path


# key -> (field, parser, default); the default is parsed too. Fields without
# a key (load, save) come from kv_role.
_SPEC: Dict[str, Tuple[str, Callable[[Any], Any], Any]] = {
    "kvkeeper_url": ("url", _url, None),
    "kvkeeper_lookup_timeout_s": ("lookup_timeout_s", _pos, 1.0),
    "kvkeeper_lookup_wait_s": ("lookup_wait_s", _nonneg, 0.005),
    "kvkeeper_io_timeout_s": ("io_timeout_s", _pos, 5.0),
    "kvkeeper_max_retries": ("max_retries", _count, 1),
    "kvkeeper_reconnect_min_s": ("reconnect_min_s", _pos, 0.1),
    "kvkeeper_reconnect_max_s": ("reconnect_max_s", _pos, 0.5),
    "kvkeeper_transport": ("transport", _choice("auto", "shm", "stream"), "auto"),
    "kvkeeper_checksum": ("checksum", _choice(*CHECKSUM_NAMES), DEFAULT_CHECKSUM),
    "kvkeeper_model_id": ("model_id", _text, None),
    "kvkeeper_model_revision": ("model_revision", _text, None),
    "kvkeeper_max_pending_save_mib": ("max_pending_save_bytes",
                                      lambda v: int(_pos(v) * (1 << 20)), 256),
    "kvkeeper_load_overlap": ("load_overlap", _choice("auto", "on", "off"), "auto"),
    "kvkeeper_recompute_on_load_failure": ("recompute_on_load_failure", _bool, True),
    "kvkeeper_report": ("report", _bool, False),
    "kvkeeper_report_residency": ("report_residency", _bool, True),
    "kvkeeper_peer": ("peer", _bool, False),
    "kvkeeper_token_file": ("token", _token_file, None),
    "kvkeeper_tls": ("tls", _bool, False),
    "kvkeeper_tls_ca_file": ("tls_ca_file", _pem_file, None),
    "kvkeeper_tls_cert_file": ("tls_cert_file", _pem_file, None),
    "kvkeeper_tls_key_file": ("tls_key_file", _pem_file, None),
}
KNOWN_KEYS = tuple(sorted(_SPEC))


@dataclass(frozen=True)
class ConnectorConfig:
    url: str
    lookup_timeout_s: float = 1.0
    lookup_wait_s: float = 0.005
    io_timeout_s: float = 5.0
    max_retries: int = 1
    reconnect_min_s: float = 0.1
    reconnect_max_s: float = 0.5
    transport: str = "auto"
    checksum: str = DEFAULT_CHECKSUM
    model_id: Optional[str] = None
    model_revision: Optional[str] = None
    max_pending_save_bytes: int = 256 << 20
    load_overlap: str = "auto"
    recompute_on_load_failure: bool = True
    report: bool = False
    report_residency: bool = True
    peer: bool = False
    token: Optional[str] = field(default=None, repr=False)   # never in a log line
    tls: bool = False
    tls_ca_file: Optional[str] = None
    tls_cert_file: Optional[str] = None
    tls_key_file: Optional[str] = None
    load: bool = True
    save: bool = True

    def client_tls(self) -> TLSLike:
        """What the client library's tls= takes: None (plain), True (system roots) or TLS."""
        files = (self.tls_ca_file, self.tls_cert_file, self.tls_key_file)
        if any(files):
            return TLS(*files)
        return True if self.tls else None

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]], kv_role: Optional[str] = None,
                   env: Optional[Mapping[str, str]] = None) -> "ConnectorConfig":
        """Parse the extra config; ConfigError names the bad key (and, for an
        unknown one, lists the known keys)."""
        if extra is not None and not isinstance(extra, Mapping):
            raise ConfigError(f"kv_connector_extra_config must be a JSON object, got {extra!r}")
        extra = dict(extra or {})
        env = os.environ if env is None else env
        unknown = sorted(k for k in extra if str(k).startswith("kvkeeper_") and k not in _SPEC)
        if unknown:
            raise ConfigError(f"unknown kv_connector_extra_config key(s) {', '.join(unknown)}; "
                              f"known keys: {', '.join(KNOWN_KEYS)}")
        if extra.get("kvkeeper_url") in (None, "") and env.get("KVKEEPER_URL"):
            extra["kvkeeper_url"] = env["KVKEEPER_URL"]
        if extra.get("kvkeeper_url") in (None, ""):
            raise ConfigError("kvkeeper_url is not set: add it to kv_connector_extra_config "
                              "(e.g. \"unix:///run/kvkeeper/kvkeeper.sock\") or set KVKEEPER_URL")
        role = kv_role or "kv_both"
        if role not in _ROLES:
            raise ConfigError(f"kv_role must be one of {', '.join(_ROLES)}, got {role!r}")
        fields: Dict[str, Any] = {}
        for key, (name, parse, default) in _SPEC.items():
            value = extra.get(key, default)
            if value is None:
                continue
            try:
                fields[name] = parse(value)
            except ValueError as e:
                raise ConfigError(f"kv_connector_extra_config {key}: {e}") from None
        if "token" not in fields and env.get("KVKEEPER_TOKEN"):
            try:
                fields["token"] = _token(env["KVKEEPER_TOKEN"])
            except ValueError as e:
                raise ConfigError(f"KVKEEPER_TOKEN: {e}") from None
        tls = fields.get("tls") or any(fields.get(f"tls_{k}_file") for k in ("ca", "cert", "key"))
        if tls and parse_url(fields["url"]).kind == "unix":
            raise ConfigError("kvkeeper_tls*: TLS is for a host:port daemon; a unix socket "
                              f"({fields['url']}) takes none: drop the kvkeeper_tls* keys")
        if bool(fields.get("tls_cert_file")) != bool(fields.get("tls_key_file")):
            raise ConfigError("kv_connector_extra_config kvkeeper_tls_cert_file and "
                              "kvkeeper_tls_key_file go together (mutual TLS needs both)")
        # A min above the (default) max raises the max: probing more often
        # than asked is not what the user meant.
        fields["reconnect_max_s"] = max(fields["reconnect_min_s"], fields["reconnect_max_s"])
        return cls(load=role in ("kv_both", "kv_consumer"),
                   save=role in ("kv_both", "kv_producer"), **fields)
