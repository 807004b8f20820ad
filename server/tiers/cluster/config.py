"""What the [cluster_tier] section means: the URL's syntax, the settings the
tier runs with, and reading the secret files (pure but for those reads; no
redis import, so the config package can check a URL without the client).

    redis://host:port[/db]                  one server (Redis or Valkey)
    rediss://host:port[/db]                 the same over TLS
    redis+cluster://host:port,host:port     a Redis/Valkey Cluster: the seed nodes
    rediss+cluster://host:port,...          a cluster over TLS

The port defaults to 6379. No credentials in the URL: the ACL user is
`username`, the password is read from `password_file` (so it is in no config
dump, no process list and no log line).
"""
from __future__ import annotations

import re
from dataclasses import dataclass
from typing import Optional

from kvkeeper.client.url import parse_host_port

from ...errors import KVKeeperError

SCHEMES = {"redis": (False, False), "rediss": (False, True),
           "redis+cluster": (True, False), "rediss+cluster": (True, True)}
DEFAULT_PORT = 6379
_PREFIX_RE = re.compile(r"^[A-Za-z0-9._:/-]{0,64}$")


class ClusterConfigError(KVKeeperError):
    """A [cluster_tier] value the tier cannot start with; `key` is "cluster_tier.<name>".
    The daemon turns it into a ConfigError naming that key."""

    def __init__(self, message: str, key: str) -> None:
        super().__init__(message)
        self.key = key


@dataclass(frozen=True)
class ClusterUrl:
    cluster: bool                       # a Redis Cluster (seed nodes), else one server
    tls: bool
    nodes: tuple[tuple[str, int], ...]
    db: int = 0

    def show(self) -> str:
        scheme = ("rediss" if self.tls else "redis") + ("+cluster" if self.cluster else "")
        hosts = ",".join(f"[{h}]:{p}" if ":" in h else f"{h}:{p}" for h, p in self.nodes)
        return f"{scheme}://{hosts}" + (f"/{self.db}" if self.db else "")


def parse_cluster_url(url: str) -> ClusterUrl:
    """ClusterUrl of a [cluster_tier] url, or ValueError saying what is wrong."""
    scheme, sep, rest = url.strip().partition("://")
    if not sep or scheme.lower() not in SCHEMES:
        raise ValueError(f"{url!r} is not a cluster URL; write redis://host:port, "
                         "rediss://host:port (TLS) or redis+cluster://host:port,host:port")
    cluster, tls = SCHEMES[scheme.lower()]
    if "@" in rest:
        raise ValueError("no credentials in the URL: set cluster_tier.username and "
                         "cluster_tier.password_file")
    if "?" in rest or "#" in rest:
        raise ValueError("the URL takes no query or fragment; the [cluster_tier] keys say the rest")
    hosts, _, db_text = rest.partition("/")
    db = 0
    if db_text:
        if cluster:
            raise ValueError("a Redis Cluster has no database number: drop the /N")
        if not db_text.isdigit():
            raise ValueError(f"database {db_text!r} is not a number")
        db = int(db_text)
    nodes = []
    for part in hosts.split(","):
        part = part.strip()
        if not part:
            raise ValueError("an empty host in the URL")
        if part.endswith("]") or (not part.startswith("[") and ":" not in part):
            part = f"{part}:{DEFAULT_PORT}"
        try:
            nodes.append(parse_host_port(part))
        except ValueError as e:
            raise ValueError(f"{part!r}: {e}") from None
    if not cluster and len(nodes) != 1:
        raise ValueError(f"{scheme}:// names one server; for several seed nodes of a "
                         f"cluster write {'rediss' if tls else 'redis'}+cluster://")
    return ClusterUrl(cluster, tls, tuple(nodes), db)


def check_key_prefix(prefix: str) -> None:
    """ValueError unless `prefix` is 0-64 of A-Z a-z 0-9 . _ : / - (no hash tag braces)."""
    if not _PREFIX_RE.match(prefix):
        raise ValueError(f"{prefix!r} is not a key prefix: use up to 64 of A-Z a-z 0-9 . _ : / - "
                         "(no braces: a hash tag would put every block in one slot)")


@dataclass(frozen=True)
class ClusterSettings:
    """What the tier runs with (from the [cluster_tier] section; see schema.py)."""

    url: ClusterUrl
    key_prefix: str = "kvk:"
    write_back: bool = False
    admit_after_hits: int = 0
    timeout_s: float = 1.0
    max_keys_per_call: int = 256
    max_connections: int = 32
    username: str = ""
    password_file: str = ""
    ca_file: str = ""
    cert_file: str = ""
    key_file: str = ""
    memory_poll_s: float = 10.0

    @property
    def prefix(self) -> bytes:
        return self.key_prefix.encode()


def read_password(path: str) -> Optional[str]:
    """The password in `path` (its first line, trailing newline dropped), None
    for no file; ClusterConfigError naming cluster_tier.password_file otherwise."""
    if not path:
        return None
    try:
        with open(path, encoding="utf-8") as f:
            text = f.read()
    except (OSError, UnicodeDecodeError) as e:
        raise ClusterConfigError(f"cluster_tier.password_file {path!r} cannot be read: {e}",
                                 "cluster_tier.password_file") from None
    password = text.splitlines()[0] if text.strip() else ""
    if not password:
        raise ClusterConfigError(f"cluster_tier.password_file {path!r} is empty",
                                 "cluster_tier.password_file")
    return password


def check_tls_keys(tls: bool, ca_file: str, cert_file: str, key_file: str) -> None:
    """ClusterConfigError naming the key of TLS settings that cannot go together:
    TLS files without rediss://, a certificate without its key (pure: no reads)."""
    files = {"ca_file": ca_file, "cert_file": cert_file, "key_file": key_file}
    given = [k for k, v in files.items() if v]
    if given and not tls:
        raise ClusterConfigError(f"cluster_tier.{given[0]} is set but cluster_tier.url is not "
                                 "TLS: write rediss:// (or rediss+cluster://)",
                                 f"cluster_tier.{given[0]}")
    if bool(cert_file) != bool(key_file):
        key = "key_file" if cert_file else "cert_file"
        raise ClusterConfigError("cluster_tier.cert_file and cluster_tier.key_file go "
                                 "together: set both or neither", f"cluster_tier.{key}")


def check_tls_files(s: ClusterSettings) -> None:
    """check_tls_keys, then ClusterConfigError naming the key of a TLS file that
    cannot be read."""
    check_tls_keys(s.url.tls, s.ca_file, s.cert_file, s.key_file)
    for name in ("ca_file", "cert_file", "key_file"):
        path = getattr(s, name)
        if path:
            try:
                with open(path, "rb"):
                    pass
            except OSError as e:
                raise ClusterConfigError(f"cluster_tier.{name} {path!r} cannot be read: {e}",
                                         f"cluster_tier.{name}") from None
