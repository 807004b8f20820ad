"""The tiers below the arena that a configuration names, opened (disk, then cluster)."""
from __future__ import annotations

from ..config import Config
from ..ledger import Ledger
from ..ops.startfaults import PATH_ERRNOS, blame
from .disk_tier import DiskTier
from .stack import LowerTier


def lower_tiers(config: Config, ledger: Ledger) -> list[LowerTier]:
    """The tiers below the arena the config names, in lookup order: disk, then cluster."""
    tiers: list[LowerTier] = []
    dt = config.disk_tier
    if dt.path:
        with blame(config, "disk_tier.path", "cannot open the disk tier there", PATH_ERRNOS,
                   path=dt.path):
            tiers.append(DiskTier.open(ledger, path=dt.path, capacity_bytes=dt.capacity_bytes,
                                       write_policy=dt.write_policy, owner_id=dt.owner_id,
                                       admit_after_hits=dt.admit_after_hits,
                                       shared_capacity_bytes=dt.shared_capacity_bytes))
    if config.cluster_tier.url:
        # Here: the redis client takes ~0.5 s to import, a cost only a daemon using it pays.
        from .cluster.settings import open_cluster_tier
        tiers.append(open_cluster_tier(config, ledger))
    return tiers
