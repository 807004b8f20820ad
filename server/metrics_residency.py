"""The gpu tier's series: every reporting engine's book, read at scrape time.

    kvkeeper_gpu_engines                         engines reporting residency now
    kvkeeper_gpu_resident_blocks{engine}         blocks in the engine's own KV cache, as reported
    kvkeeper_gpu_resident_bytes{engine}          those blocks' bytes (block_bytes of its namespace)
    kvkeeper_gpu_capacity_blocks{engine}         its KV cache's capacity, as reported
    kvkeeper_residency_reports_total             ReportResidency calls applied
    kvkeeper_residency_events_total              residency events issued (WatchEvents' last seq)
    kvkeeper_residency_events_dropped_total      events dropped from the replay buffer

`engine` is a reporting session's public tag ("s1a", as Locate and
WatchEvents name it): one series per live reporting session, gone when the
session ends, so the label's values are bounded by the number of engines
registered at once, never by keys or requests. (A daemon that sees engines
come and go keeps each series only while its engine lives.)

Thread safety as in metrics.py: only Residency.engine_list (a tuple the loop
replaces, never changes) is iterated, and only len() and scalars are read.
"""
from __future__ import annotations

from typing import TYPE_CHECKING

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

if TYPE_CHECKING:  # pragma: no cover
    from .ledger.residency import Residency

PREFIX = "kvkeeper_"


def residency_families(r: "Residency") -> list[Metric]:
    p, engine = PREFIX, ["engine"]
    engines = GaugeMetricFamily(p + "gpu_engines", "Engines reporting what their own KV "
                                "cache holds (the gpu tier).")
    blocks = GaugeMetricFamily(p + "gpu_resident_blocks", "Blocks an engine's own KV cache "
                               "holds, as its connector reported.", labels=engine)
    nbytes = GaugeMetricFamily(p + "gpu_resident_bytes", "Bytes of the blocks an engine's own "
                               "KV cache holds, as reported.", labels=engine)
    cap = GaugeMetricFamily(p + "gpu_capacity_blocks", "Blocks an engine's KV cache holds "
                            "at most, as reported.", labels=engine)
    books = r.engine_list
    engines.add_metric([], len(books))
    for b in books:
        n = len(b.blocks)
        blocks.add_metric([b.engine], n)
        nbytes.add_metric([b.engine], n * b.block_bytes)
        cap.add_metric([b.engine], b.capacity_blocks)
    reports = CounterMetricFamily(p + "residency_reports", "ReportResidency calls applied.")
    reports.add_metric([], r.reports)
    issued = CounterMetricFamily(p + "residency_events", "Residency events issued (the "
                                 "newest WatchEvents sequence number).")
    issued.add_metric([], r.log.last_seq)
    dropped = CounterMetricFamily(p + "residency_events_dropped", "Residency events dropped "
                                  "from the replay buffer (a watcher resuming before them "
                                  "is told of the gap).")
    dropped.add_metric([], r.log.dropped)
    return [engines, blocks, nbytes, cap, reports, issued, dropped]
