"""The installed kvkeeper's version: what `kvkeeper version`, the Stats RPC, the
kvkeeper_build_info metric and experiment artifacts report."""
from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

UNKNOWN = "unknown"


def package_version() -> str:
    """The kvkeeper distribution's version, or "unknown" when running from a source tree
    that was never installed."""
    try:
        return version("kvkeeper")
    except PackageNotFoundError:
        return UNKNOWN
