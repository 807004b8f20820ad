"""Every metric the alert rules and the Grafana dashboard query is one the daemon
exports: names are pulled out of each PromQL expression and looked up in the
/metrics text of a freshly built daemon (ledger, arena, disk and cluster tiers, as
`kvkeeper serve` assembles them). Also the dashboard's structure."""
from __future__ import annotations

import asyncio
import json
import shutil
import tempfile
import uuid

import pytest
from deploy_support import DEPLOY, dashboard_exprs, free_port, metric_names
from kvkeeper.server.app import create_server
from kvkeeper.server.config import load_config
from prometheus_client.parser import text_string_to_metric_families

yaml = pytest.importorskip("yaml")

RULES = sorted((DEPLOY / "prometheus/rules").glob("*.yml"))
DASHBOARDS = sorted((DEPLOY / "grafana/dashboards").glob("*.json"))
# Series that Prometheus itself records for every scrape target.
PROMETHEUS_SYNTHETIC = {"up", "scrape_duration_seconds", "scrape_samples_scraped"}


@pytest.fixture(scope="module")
def exported() -> set[str]:
    """Sample names of a real daemon's /metrics (counters as _total, histograms as
    _bucket/_sum/_count), with a disk and a cluster tier so their series are there too."""
    d = tempfile.mkdtemp(prefix="kvkm-", dir="/tmp")
    try:
        config = load_config(None, env={}, overrides={
            "listen.socket": f"{d}/kvk.sock", "listen.tcp": "", "metrics.address": "",
            "host_tier.capacity_bytes": 4096 + 64 * 4096, "host_tier.page_bytes": 4096,
            "host_tier.name": f"kvkeeper-names-{uuid.uuid4().hex[:12]}",
            "disk_tier.path": f"{d}/disk", "disk_tier.capacity_bytes": 1 << 20,
            # A cluster tier whose server is not there: its series exist all the same.
            "cluster_tier.url": f"redis://127.0.0.1:{free_port()}",
            "cluster_tier.timeout_seconds": 0.5,
        })
        async def render() -> str:
            # grpc.aio wants a running loop to build its server.
            daemon, _ = create_server(config)
            try:
                return daemon.metrics.render().decode()
            finally:
                try:
                    for tier in (getattr(daemon, "disk", None), getattr(daemon, "cluster", None)):
                        if tier is not None:
                            await tier.close()
                finally:
                    daemon.arena.close()

        text = asyncio.run(render())
    finally:
        shutil.rmtree(d, ignore_errors=True)
    names = {s.name for fam in text_string_to_metric_families(text) for s in fam.samples}
    assert "kvkeeper_tier_capacity_bytes" in names
    return names


def rule_exprs() -> list[tuple[str, str]]:
    out = []
    for path in RULES:
        for group in yaml.safe_load(path.read_text())["groups"]:
            for rule in group["rules"]:
                out.append((f"{path.name}: {rule.get('alert') or rule.get('record')}", rule["expr"]))
    return out


def test_the_extractor() -> None:
    e = ('histogram_quantile(0.99, sum by (le, method) (rate(kvkeeper_rpc_duration_seconds_bucket'
         '{job=~"$job", method=~"Load|LoadStream"}[$__rate_interval]))) / ignoring(tier) '
         'group_left sum(rate(kvkeeper_lookup_keys_total[1h] offset 1h)) and on (job) up == 0')
    assert metric_names(e) == {"kvkeeper_rpc_duration_seconds_bucket",
                               "kvkeeper_lookup_keys_total", "up"}
    assert metric_names('absent(up{job="kvkeeper"})') == {"up"}
    assert metric_names('sum(x_total) > bool 1e-3') == {"x_total"}


def test_rules_use_only_exported_metrics(exported: set[str]) -> None:
    exprs = rule_exprs()
    assert len(exprs) >= 8
    seen = set()
    for where, expr in exprs:
        names = metric_names(expr)
        assert names, f"{where}: no metric found in {expr!r}"
        missing = names - exported - PROMETHEUS_SYNTHETIC
        assert not missing, f"{where}: {sorted(missing)} not exported by the daemon"
        seen |= names
    # The rules cover what the issue asked for.
    for name in ("up", "kvkeeper_tier_pinned_bytes", "kvkeeper_rpc_errors_total",
                 "kvkeeper_hit_tokens_total", "kvkeeper_lookup_tokens_total",
                 "kvkeeper_disk_checksum_failures_total",
                 "kvkeeper_evictions_total", "kvkeeper_cluster_up",
                 "kvkeeper_cluster_errors_total", "kvkeeper_cluster_corrupt_values_total"):
        assert name in seen, name


def test_dashboard_uses_only_exported_metrics(exported: set[str]) -> None:
    assert DASHBOARDS
    for path in DASHBOARDS:
        exprs = dashboard_exprs(json.loads(path.read_text()))
        assert len(exprs) >= 20
        for where, expr in exprs:
            names = metric_names(expr)
            assert names, f"{path.name} {where}: no metric in {expr!r}"
            missing = names - exported
            assert not missing, f"{path.name} {where}: {sorted(missing)} not exported"


def test_checksum_failures_metric_note() -> None:
    """The rules say why there is no kvkeeper_checksum_failures_total rule: keep that
    note honest if the metric appears one day."""
    text = "\n".join(p.read_text() for p in RULES)
    assert "no kvkeeper_checksum_failures_total" in text


def test_dashboard_structure() -> None:
    for path in DASHBOARDS:
        d = json.loads(path.read_text())
        assert d["uid"] and d["title"] and d["schemaVersion"] >= 36
        names = [v["name"] for v in d["templating"]["list"]]
        assert names == ["datasource", "job", "instance"]
        ids = [p["id"] for p in d["panels"]]
        assert len(ids) == len(set(ids)), "panel ids must be unique"
        boxes = []
        for p in d["panels"]:
            g = p["gridPos"]
            assert 0 <= g["x"] and g["x"] + g["w"] <= 24, p["title"]
            cells = {(x, y) for x in range(g["x"], g["x"] + g["w"])
                     for y in range(g["y"], g["y"] + g["h"])}
            for other_title, other in boxes:
                assert not cells & other, f"{p['title']!r} overlaps {other_title!r}"
            boxes.append((p["title"], cells))
            if p["type"] == "row":
                continue
            assert p["datasource"] == {"type": "prometheus", "uid": "${datasource}"}, p["title"]
            assert p["targets"], p["title"]
            for t in p["targets"]:
                assert t["datasource"]["uid"] == "${datasource}"
                assert 'job=~"$job"' in t["expr"] and 'instance=~"$instance"' in t["expr"], \
                    (p["title"], t["expr"])
            refs = [t["refId"] for t in p["targets"]]
            assert len(refs) == len(set(refs))
        titles = " ".join(p["title"].lower() for p in d["panels"])
        for topic in ("hit rate", "load latency", "bytes per tier", "evictions", "errors"):
            assert topic in titles, topic
