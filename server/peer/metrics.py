"""The peer socket's series, read at scrape time (registered beside the ledger's collector).

    kvkeeper_peer_segments              engines' KV caches registered for same-host peers now
    kvkeeper_peer_published_blocks      (key, block) entries those segments publish now
    kvkeeper_peer_lookups_total         peer lookups answered (a lookup the tiers answered short)
    kvkeeper_peer_lookup_hits_total     of those, lookups that named a peer's segment
    kvkeeper_peer_lookup_hit_blocks_total  blocks those hits named

No label: the segments are counted, not named. Thread safety as in
metrics.py: the event loop keeps these numbers up to date; a scrape only
reads integers.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Iterator, List

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:  # pragma: no cover
    from .service import PeerService

__all__ = ["PeerCollector"]

P = "kvkeeper_peer_"


class PeerCollector:
    def __init__(self, service: "PeerService") -> None:
        self._service = service

    def _families(self) -> List[Metric]:
        s = self._service
        segments = GaugeMetricFamily(P + "segments", "Engines' KV caches registered for "
                                     "same-host peers.")
        segments.add_metric([], s.stats.segments)
        published = GaugeMetricFamily(P + "published_blocks", "Blocks the registered KV caches "
                                      "publish (key, block, generation).")
        published.add_metric([], s.stats.published)
        lookups = CounterMetricFamily(P + "lookups", "Peer lookups answered.")
        lookups.add_metric([], s.stats.lookups)
        hits = CounterMetricFamily(P + "lookup_hits", "Peer lookups that named a peer's KV cache.")
        hits.add_metric([], s.stats.hits)
        blocks = CounterMetricFamily(P + "lookup_hit_blocks", "Blocks the peer lookups' hits "
                                     "named.")
        blocks.add_metric([], s.stats.hit_blocks)
        return [segments, published, lookups, hits, blocks]

    def describe(self) -> Iterator[Metric]:
        return iter(self._families())

    def collect(self) -> Iterator[Metric]:
        return iter(self._families())
