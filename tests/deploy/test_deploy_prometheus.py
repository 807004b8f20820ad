"""deploy/prometheus with the real tools: promtool checks the config and rules and
runs the rules' unit tests; a real Prometheus scrapes a real `kvkeeper serve`,
answers a kvkeeper metric through /api/v1/query, evaluates every alert rule and
every dashboard expression without error, and raises KVKeeperDown once the
daemon stops. All traffic stays on 127.0.0.1."""
from __future__ import annotations

import json
import shutil
import subprocess
import tempfile
import urllib.error
import urllib.parse
import urllib.request
from pathlib import Path
from typing import Any, Iterator, Optional

import pytest
from deploy_support import (
    DEPLOY,
    clean_env,
    dashboard_exprs,
    free_port,
    grafana_to_promql,
    serve_args,
    socket_accepts,
    stop,
    wait_until,
)

yaml = pytest.importorskip("yaml")

PROM_DIR = DEPLOY / "prometheus"
CONFIG = PROM_DIR / "prometheus.yml"
RULES = PROM_DIR / "rules" / "kvkeeper.rules.yml"
RULE_TESTS = PROM_DIR / "tests" / "kvkeeper.rules.test.yml"
DASHBOARD = DEPLOY / "grafana" / "dashboards" / "kvkeeper.json"

needs_promtool = pytest.mark.skipif(shutil.which("promtool") is None,
                                    reason="promtool not installed (Debian package prometheus)")
needs_prometheus = pytest.mark.skipif(shutil.which("prometheus") is None,
                                      reason="prometheus not installed (Debian package prometheus)")


def promtool(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["promtool", *args], capture_output=True, text=True, timeout=120)


# --------------------------------------------------------------------------- promtool
@needs_promtool
def test_promtool_check_config() -> None:
    r = promtool("check", "config", str(CONFIG))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "1 rule files found" in r.stdout + r.stderr  # rules/*.yml resolved beside it


@needs_promtool
def test_promtool_check_rules() -> None:
    r = promtool("check", "rules", str(RULES))
    assert r.returncode == 0, r.stdout + r.stderr


@needs_promtool
def test_promtool_rule_unit_tests() -> None:
    r = promtool("test", "rules", str(RULE_TESTS))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "SUCCESS" in r.stdout


@needs_promtool
def test_every_alert_has_a_unit_test() -> None:
    alerts = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"] for r in g["rules"]
              if "alert" in r}
    tests = yaml.safe_load(RULE_TESTS.read_text())["tests"]
    tested = {a["alertname"] for t in tests for a in t.get("alert_rule_test", [])}
    tested |= {name for t in tests for e in t.get("promql_expr_test", [])
               for name in alerts if f'"{name}"' in e["expr"]}
    assert alerts <= tested | {"KVKeeperSavesRejected"}, sorted(alerts - tested)
    # KVKeeperSavesRejected's expression is tested as a promql_expr_test.
    assert any("RESOURCE_EXHAUSTED" in e["expr"] for t in tests
               for e in t.get("promql_expr_test", []))


# --------------------------------------------------------------------------- a live Prometheus
class Prom:
    def __init__(self, port: int) -> None:
        self.base = f"http://127.0.0.1:{port}"

    def get(self, path: str, **params: str) -> Any:
        url = self.base + path + ("?" + urllib.parse.urlencode(params) if params else "")
        with urllib.request.urlopen(url, timeout=10) as resp:
            return json.loads(resp.read().decode())

    def query(self, q: str) -> list[dict]:
        body = self.get("/api/v1/query", query=q)
        assert body["status"] == "success", body
        return body["data"]["result"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.base + "/-/ready", timeout=2) as resp:
                return resp.status == 200
        except (urllib.error.URLError, ConnectionError, OSError):
            return False


@pytest.fixture
def workdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvkp-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def prometheus_config(metrics_port: int) -> dict:
    """deploy/prometheus/prometheus.yml with its kvkeeper job aimed at the test daemon,
    1 s intervals, the rules by absolute path, and no other (non-loopback) jobs."""
    cfg = yaml.safe_load(CONFIG.read_text())
    cfg["global"]["scrape_interval"] = "1s"
    cfg["global"]["evaluation_interval"] = "1s"
    cfg["global"]["scrape_timeout"] = "1s"
    cfg["rule_files"] = [str((PROM_DIR / r).resolve()) for r in cfg["rule_files"]]
    [job] = [j for j in cfg["scrape_configs"] if j["job_name"] == "kvkeeper"]
    job["static_configs"] = [{"targets": [f"127.0.0.1:{metrics_port}"]}]
    cfg["scrape_configs"] = [job]
    return cfg


def scrape_direct(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as resp:
        return resp.read().decode()


@needs_prometheus
def test_prometheus_scrapes_the_daemon_and_evaluates_rules_and_dashboard(workdir: Path) -> None:
    from prometheus_client.parser import text_string_to_metric_families

    sock = workdir / "kvk.sock"
    mport = free_port()
    daemon = subprocess.Popen(serve_args(sock, metrics=f"127.0.0.1:{mport}"),
                              stderr=subprocess.PIPE, text=True, env=clean_env())
    prom_proc: Optional[subprocess.Popen] = None
    prom_log = workdir / "prometheus.log"
    try:
        wait_until(lambda: socket_accepts(sock), 30, "the daemon's socket", daemon)
        expected = next(s.value for fam in text_string_to_metric_families(scrape_direct(mport))
                        for s in fam.samples
                        if s.name == "kvkeeper_tier_capacity_bytes" and s.labels == {"tier": "host"})

        cfg_path = workdir / "prometheus.yml"
        cfg_path.write_text(yaml.safe_dump(prometheus_config(mport)))
        if shutil.which("promtool"):
            r = promtool("check", "config", str(cfg_path))
            assert r.returncode == 0, r.stdout + r.stderr
        pport = free_port()
        with open(prom_log, "w") as log:
            prom_proc = subprocess.Popen(
                ["prometheus", f"--config.file={cfg_path}", f"--storage.tsdb.path={workdir}/data",
                 f"--web.listen-address=127.0.0.1:{pport}"],
                stdout=log, stderr=subprocess.STDOUT, cwd=workdir)
        prom = Prom(pport)

        def log_tail() -> str:
            return prom_log.read_text()[-3000:]

        try:
            wait_until(prom.ready, 60, "Prometheus /-/ready", prom_proc, interval=0.2)

            # A kvkeeper metric, read back through Prometheus's query API.
            q = 'kvkeeper_tier_capacity_bytes{job="kvkeeper", tier="host"}'
            result = wait_until(lambda: prom.query(q), 60, f"{q} in Prometheus", prom_proc,
                                interval=0.5)
            assert float(result[0]["value"][1]) == expected
            assert result[0]["metric"]["instance"] == f"127.0.0.1:{mport}"
            [up] = prom.query('up{job="kvkeeper"}')
            assert up["value"][1] == "1"

            # Every rule loaded and evaluated without error.
            def rules_evaluated() -> Optional[list[dict]]:
                groups = prom.get("/api/v1/rules")["data"]["groups"]
                rules = [r for g in groups for r in g["rules"]]
                if rules and all(not r["lastEvaluation"].startswith("0001") for r in rules):
                    return rules
                return None

            rules = wait_until(rules_evaluated, 30, "a rule evaluation", prom_proc, interval=0.5)
            names = {r["name"] for r in rules}
            want = {r["alert"] for g in yaml.safe_load(RULES.read_text())["groups"]
                    for r in g["rules"]}
            assert names == want
            bad = [(r["name"], r.get("lastError")) for r in rules if r["health"] != "ok"]
            assert not bad, bad
            # A healthy, idle daemon raises nothing (an evaluation that ran before the
            # first scrape may have had KVKeeperTargetMissing pending for a moment).
            wait_until(lambda: not prom.get("/api/v1/alerts")["data"]["alerts"], 15,
                       "no pending or firing alerts", prom_proc, interval=0.5)

            # Every dashboard query parses and runs (Grafana's variables filled in).
            dashboard = json.loads(DASHBOARD.read_text())
            for where, expr in dashboard_exprs(dashboard):
                q = grafana_to_promql(expr)
                body = prom.get("/api/v1/query", query=q)
                assert body["status"] == "success", (where, q, body)
            # ... and the overview's up-count sees this daemon.
            [panel] = [p for p in dashboard["panels"] if p["title"] == "Daemons up"]
            [n] = prom.query(grafana_to_promql(panel["targets"][0]["expr"]))
            assert n["value"][1] == "1"

            # The daemon goes away: the scrape fails and KVKeeperDown goes pending.
            rc, err = stop(daemon)
            assert rc == 0, err

            def down_pending() -> bool:
                alerts = prom.get("/api/v1/alerts")["data"]["alerts"]
                return any(a["labels"]["alertname"] == "KVKeeperDown"
                           and a["labels"]["instance"] == f"127.0.0.1:{mport}"
                           and a["state"] in ("pending", "firing") for a in alerts)

            wait_until(down_pending, 30, "KVKeeperDown to go pending", prom_proc, interval=0.5)
            [up] = prom.query('up{job="kvkeeper"}')
            assert up["value"][1] == "0"
        except AssertionError as e:
            raise AssertionError(f"{e}\n--- prometheus log ---\n{log_tail()}") from None
    finally:
        if prom_proc is not None:
            prom_proc.terminate()
            try:
                prom_proc.wait(timeout=20)
            except subprocess.TimeoutExpired:
                prom_proc.kill()
                prom_proc.wait()
        if daemon.poll() is None:
            stop(daemon)
