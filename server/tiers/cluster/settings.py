"""From the daemon's [cluster_tier] section to a running ClusterTier, with a
start-up error that names the key at fault and where its value came from."""
from __future__ import annotations

from ...config import Config, ConfigError
from ...ledger import Ledger
from .config import ClusterConfigError, ClusterSettings, parse_cluster_url
from .tier import ClusterTier


def cluster_settings(config: Config) -> ClusterSettings:
    """The tier's settings from a loaded (validated) configuration."""
    ct = config.cluster_tier
    return ClusterSettings(
        url=parse_cluster_url(ct.url), key_prefix=ct.key_prefix,
        write_back=ct.write_policy == "write-back", admit_after_hits=ct.admit_after_hits,
        timeout_s=ct.timeout_seconds, max_keys_per_call=ct.max_keys_per_call,
        max_connections=ct.max_connections, username=ct.username,
        password_file=ct.password_file, ca_file=ct.ca_file, cert_file=ct.cert_file,
        key_file=ct.key_file)


def open_cluster_tier(config: Config, ledger: Ledger) -> ClusterTier:
    """ClusterTier.open with the configuration's settings; ConfigError naming
    the [cluster_tier] key (and its source) the cluster or the files refuse."""
    try:
        return ClusterTier.open(ledger, cluster_settings(config))
    except ClusterConfigError as e:
        src = config.source_of(e.key)
        raise ConfigError(f"{e} ({e.key} from {src})", key=e.key, source=src) from None
