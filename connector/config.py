"""The connector's settings, read from kv_transfer_config.kv_connector_extra_config.

    --kv-transfer-config '{"kv_connector": "KVKeeperConnector",
                           "kv_connector_module_path": "kvkeeper.connector",
                           "kv_role": "kv_both",
                           "kv_connector_extra_config": {"kvkeeper_url": "unix:///run/kvkeeper/kvkeeper.sock"}}'

| key | default | meaning |
|---|---|---|
| kvkeeper_url | $KVKEEPER_URL | the daemon: unix:///path, unix:path, host:port |
| kvkeeper_lookup_timeout_s | 1.0 | deadline of a scheduler lookup (Match); a slower daemon is a miss |
| kvkeeper_lookup_wait_s | 0.005 | longest wait for lookup answers per scheduling step, all requests together; a request still unanswered is skipped and asked again next step (0: never wait) |
| kvkeeper_io_timeout_s | 5.0 | deadline of each load / save RPC |
| kvkeeper_max_retries | 1 | retries of an idempotent RPC on UNAVAILABLE |
| kvkeeper_reconnect_min_s / _max_s | 0.5 / 10 | backoff between attempts to reach a daemon that failed |
| kvkeeper_transport | auto | auto (shared memory on the daemon's host, else streaming), shm, stream |
| kvkeeper_checksum | crc32 | crc32 or none |
| kvkeeper_model_id / kvkeeper_model_revision | from vLLM | override the namespace's model identity |
| kvkeeper_load_overlap | auto | where loaded blocks are copied in and checked. on: on a connector thread on the cores vLLM's CPU backend leaves to the rest of the engine, layer by layer beside the forward; off: before the forward, in vLLM's thread; auto: on with at least 2 such cores; with 1 (which the engine core's busy polling shares: "on" measured slower there) before the forward, the connector thread doing half of it beside vLLM's thread |
| kvkeeper_max_pending_save_mib | 256 | copied-out blocks waiting to be sent; beyond, saves are dropped |
| kvkeeper_recompute_on_load_failure | true | set vLLM's kv_load_failure_policy to "recompute" (a cache miss must not fail a request) |
| kvkeeper_report | false | add {"kvkeeper": {...}} (hit tokens, saved blocks, namespace) to each request's kv_transfer_params |

kv_role picks the directions: kv_producer saves only, kv_consumer loads only,
kv_both does both.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any, Mapping, Optional

__all__ = ["ConnectorConfig"]

_TRUE = {"1", "true", "yes", "on"}
_FALSE = {"0", "false", "no", "off", ""}


def _bool(v: Any, key: str) -> bool:
    if isinstance(v, bool):
        return v
    s = str(v).strip().lower()
    if s in _TRUE:
        return True
    if s in _FALSE:
        return False
    raise ValueError(f"{key} must be a boolean, got {v!r}")


def _nonneg(v: Any, key: str) -> float:
    f = float(v)
    if not f >= 0:
        raise ValueError(f"{key} must be >= 0, got {v!r}")
    return f


def _pos(v: Any, key: str) -> float:
    f = float(v)
    if not f > 0:
        raise ValueError(f"{key} must be > 0, got {v!r}")
    return f


@dataclass(frozen=True)
class ConnectorConfig:
    url: str
    lookup_timeout_s: float = 1.0
    lookup_wait_s: float = 0.005
    io_timeout_s: float = 5.0
    max_retries: int = 1
    reconnect_min_s: float = 0.5
    reconnect_max_s: float = 10.0
    transport: str = "auto"
    checksum: str = "crc32"
    model_id: Optional[str] = None
    model_revision: Optional[str] = None
    max_pending_save_bytes: int = 256 << 20
    load_overlap: str = "auto"
    recompute_on_load_failure: bool = True
    report: bool = False
    load: bool = True
    save: bool = True

    @classmethod
    def from_extra(cls, extra: Optional[Mapping[str, Any]], kv_role: Optional[str] = None,
                   env: Optional[Mapping[str, str]] = None) -> "ConnectorConfig":
        """Parse the extra config; ValueError names the bad key."""
        extra = dict(extra or {})
        env = os.environ if env is None else env
        url = str(extra.get("kvkeeper_url") or env.get("KVKEEPER_URL") or "")
        if not url:
            raise ValueError("kvkeeper_url is not set: add it to kv_connector_extra_config "
                             "(e.g. \"unix:///run/kvkeeper/kvkeeper.sock\") or set KVKEEPER_URL")
        unknown = sorted(k for k in extra if k.startswith("kvkeeper_") and k not in _KEYS)
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config key(s) {unknown}; "
                             f"known: {sorted(_KEYS)}")
        transport = str(extra.get("kvkeeper_transport", "auto"))
        if transport not in ("auto", "shm", "stream"):
            raise ValueError(f"kvkeeper_transport must be auto, shm or stream, got {transport!r}")
        checksum = str(extra.get("kvkeeper_checksum", "crc32"))
        if checksum not in ("crc32", "none"):
            raise ValueError(f"kvkeeper_checksum must be crc32 or none, got {checksum!r}")
        overlap = str(extra.get("kvkeeper_load_overlap", "auto"))
        if overlap not in ("auto", "on", "off"):
            raise ValueError(f"kvkeeper_load_overlap must be auto, on or off, got {overlap!r}")
        retries = int(extra.get("kvkeeper_max_retries", 1))
        if retries < 0:
            raise ValueError(f"kvkeeper_max_retries must be >= 0, got {retries}")
        rmin = _pos(extra.get("kvkeeper_reconnect_min_s", 0.5), "kvkeeper_reconnect_min_s")
        rmax = _pos(extra.get("kvkeeper_reconnect_max_s", 10.0), "kvkeeper_reconnect_max_s")
        role = kv_role or "kv_both"
        model_id = extra.get("kvkeeper_model_id")
        revision = extra.get("kvkeeper_model_revision")
        return cls(
            url=url,
            lookup_timeout_s=_pos(extra.get("kvkeeper_lookup_timeout_s", 1.0),
                                  "kvkeeper_lookup_timeout_s"),
            lookup_wait_s=_nonneg(extra.get("kvkeeper_lookup_wait_s", 0.005),
                                  "kvkeeper_lookup_wait_s"),
            io_timeout_s=_pos(extra.get("kvkeeper_io_timeout_s", 5.0), "kvkeeper_io_timeout_s"),
            max_retries=retries,
            reconnect_min_s=rmin,
            reconnect_max_s=max(rmin, rmax),
            transport=transport,
            checksum=checksum,
            model_id=None if model_id is None else str(model_id),
            model_revision=None if revision is None else str(revision),
            max_pending_save_bytes=int(_pos(extra.get("kvkeeper_max_pending_save_mib", 256),
                                            "kvkeeper_max_pending_save_mib") * (1 << 20)),
            load_overlap=overlap,
            recompute_on_load_failure=_bool(extra.get("kvkeeper_recompute_on_load_failure", True),
                                            "kvkeeper_recompute_on_load_failure"),
            report=_bool(extra.get("kvkeeper_report", False), "kvkeeper_report"),
            load=role in ("kv_both", "kv_consumer"),
            save=role in ("kv_both", "kv_producer"),
        )


_KEYS = {"kvkeeper_url", "kvkeeper_lookup_timeout_s", "kvkeeper_lookup_wait_s",
         "kvkeeper_io_timeout_s",
         "kvkeeper_max_retries", "kvkeeper_reconnect_min_s", "kvkeeper_reconnect_max_s",
         "kvkeeper_transport", "kvkeeper_checksum", "kvkeeper_model_id",
         "kvkeeper_model_revision", "kvkeeper_max_pending_save_mib", "kvkeeper_load_overlap",
         "kvkeeper_recompute_on_load_failure", "kvkeeper_report"}
