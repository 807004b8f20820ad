"""Prometheus metrics: names, zero series at start-up, values that follow the
ledger, label hygiene, the HTTP exporter and `promtool check metrics`."""
from __future__ import annotations

import hashlib
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.parser import text_string_to_metric_families

from kvkeeper.client.url import parse_host_port
from kvkeeper.server.ledger import Ledger, LedgerConfig, NamespaceDescriptor, TierSpec
from kvkeeper.server.metrics import (DIRECTIONS, EVICTION_REASONS, HELD_RPC_METHODS,
                                     RPC_ERROR_CODES, RPC_METHODS, TRANSPORTS, Metrics)

PAGE = 4096
PAGES = 64
NS = NamespaceDescriptor(model_id="m", block_tokens=16, block_bytes=2 * PAGE)  # 2 pages a block

LEDGER_METRICS = {
    "kvkeeper_up", "kvkeeper_build_info", "kvkeeper_start_time_seconds",
    "kvkeeper_lookups_total", "kvkeeper_lookup_keys_total",
    "kvkeeper_lookup_blocks_total", "kvkeeper_lookup_tokens_total",
    "kvkeeper_prompt_blocks_total", "kvkeeper_prompt_tokens_total",
    "kvkeeper_hit_blocks_total", "kvkeeper_hit_tokens_total",
    "kvkeeper_saved_blocks_total", "kvkeeper_saved_bytes_total", "kvkeeper_evictions_total",
    "kvkeeper_admission_refused_total", "kvkeeper_last_turn_blocks_total",
    "kvkeeper_tier_capacity_bytes", "kvkeeper_tier_used_bytes", "kvkeeper_tier_pinned_bytes",
    "kvkeeper_tier_evictable_bytes", "kvkeeper_tier_page_size_bytes",
    "kvkeeper_tier_capacity_pages", "kvkeeper_tier_used_pages", "kvkeeper_tier_blocks",
    "kvkeeper_sessions", "kvkeeper_leases", "kvkeeper_reservations", "kvkeeper_namespaces",
    "kvkeeper_sessions_expired_total", "kvkeeper_sessions_ended_total",
    "kvkeeper_reservations_timed_out_total",
    # the gpu tier (metrics_residency.py); the per-engine series exist per reporting engine
    "kvkeeper_gpu_engines", "kvkeeper_residency_reports_total", "kvkeeper_residency_events_total",
    "kvkeeper_residency_events_dropped_total",
}
OWNED_METRICS = {
    "kvkeeper_rpc_duration_seconds_bucket", "kvkeeper_rpc_duration_seconds_count",
    "kvkeeper_rpc_duration_seconds_sum", "kvkeeper_rpc_errors_total",
    "kvkeeper_transfer_bytes_total", "kvkeeper_transfer_duration_seconds_bucket",
    "kvkeeper_transfer_duration_seconds_count", "kvkeeper_transfer_duration_seconds_sum",
}
# Series whose value is not zero on a fresh ledger.
NONZERO_AT_START = {
    "kvkeeper_up", "kvkeeper_build_info", "kvkeeper_start_time_seconds",
    "kvkeeper_tier_capacity_bytes", "kvkeeper_tier_page_size_bytes", "kvkeeper_tier_capacity_pages",
}
# engine: one value per live session reporting residency (metrics_residency.py)
ALLOWED_LABELS = {"tier", "reason", "method", "code", "transport", "direction", "state",
                  "version", "le", "engine"}


def key(i: int) -> bytes:
    return hashlib.sha256(b"block-%d" % i).digest()


def make(**cfg) -> tuple[Metrics, Ledger]:
    ledger = Ledger(LedgerConfig(tiers=[TierSpec("host", PAGES * PAGE, PAGE)], **cfg))
    metrics = Metrics()
    metrics.attach_ledger(ledger, started_at=time.monotonic() - 100.0)
    return metrics, ledger


def samples(metrics: Metrics) -> dict[tuple[str, frozenset], float]:
    out: dict[tuple[str, frozenset], float] = {}
    for fam in text_string_to_metric_families(metrics.render().decode()):
        for s in fam.samples:
            out[(s.name, frozenset(s.labels.items()))] = s.value
    return out


def val(metrics_or_samples, name: str, **labels) -> float:
    s = samples(metrics_or_samples) if isinstance(metrics_or_samples, Metrics) else metrics_or_samples
    return s[(name, frozenset(labels.items()))]


def kv_samples(s: dict) -> dict:
    return {k: v for k, v in s.items() if k[0].startswith("kvkeeper_")}


# ------------------------------------------------------------------ names and zeros
def test_every_series_exists_at_zero_on_a_fresh_ledger():
    m, _ = make()
    s = kv_samples(samples(m))
    names = {n for n, _ in s}
    assert LEDGER_METRICS | OWNED_METRICS == names
    for (name, labels), v in s.items():
        if name in NONZERO_AT_START:
            continue
        assert v == 0, (name, dict(labels), v)

    assert val(s, "kvkeeper_up") == 1
    # started_at is monotonic (100 s ago); the series is Unix time.
    assert val(s, "kvkeeper_start_time_seconds") == pytest.approx(time.time() - 100.0, abs=5.0)
    assert val(s, "kvkeeper_tier_capacity_bytes", tier="host") == PAGES * PAGE
    assert val(s, "kvkeeper_tier_capacity_pages", tier="host") == PAGES
    assert val(s, "kvkeeper_tier_page_size_bytes", tier="host") == PAGE
    [(version_labels, one)] = [(dict(l), v) for (n, l), v in s.items() if n == "kvkeeper_build_info"]
    assert one == 1 and set(version_labels) == {"version"} and version_labels["version"]

    for reason in EVICTION_REASONS:
        assert val(s, "kvkeeper_evictions_total", tier="host", reason=reason) == 0
    for state in ("committed", "pending"):
        assert val(s, "kvkeeper_tier_blocks", tier="host", state=state) == 0
    for method in RPC_METHODS:
        if method in HELD_RPC_METHODS:   # no duration: the series does not exist
            assert ("kvkeeper_rpc_duration_seconds_count",
                    frozenset({("method", method)})) not in s
        else:
            assert val(s, "kvkeeper_rpc_duration_seconds_count", method=method) == 0
            assert val(s, "kvkeeper_rpc_duration_seconds_bucket", method=method, le="+Inf") == 0
        for code in RPC_ERROR_CODES:
            assert val(s, "kvkeeper_rpc_errors_total", method=method, code=code) == 0
    for d in DIRECTIONS:
        for t in TRANSPORTS:
            assert val(s, "kvkeeper_transfer_bytes_total", direction=d, transport=t) == 0
            assert val(s, "kvkeeper_transfer_duration_seconds_count", direction=d, transport=t) == 0


def test_rpc_methods_match_the_proto():
    import pathlib
    proto = pathlib.Path(__file__).resolve().parents[2] / "proto/kvkeeper/v1/kvkeeper.proto"
    if not proto.exists():
        pytest.skip("proto source not in this checkout")
    text = proto.read_text()
    service = text[text.index("service KVKeeper"):]
    service = service[:service.index("}")]
    assert tuple(re.findall(r"rpc\s+(\w+)\s*\(", service)) == RPC_METHODS


def test_histogram_buckets_span_50us_to_10s():
    m, _ = make()
    s = samples(m)
    les = {float(dict(l)["le"]) for (n, l) in s if n == "kvkeeper_transfer_duration_seconds_bucket"}
    finite = sorted(x for x in les if x != float("inf"))
    assert finite[0] <= 50e-6 and finite[-1] >= 10.0


def test_metrics_without_a_ledger_still_render_owned_series():
    m = Metrics()
    names = {n for n, _ in kv_samples(samples(m))}
    assert names == OWNED_METRICS
    assert b"process_" in m.render() or sys.platform != "linux"


def test_many_instances_and_a_second_attach():
    m1, ledger = make()
    m2, _ = make()
    assert samples(m1) and samples(m2)
    with pytest.raises(RuntimeError):
        m1.attach_ledger(ledger, time.monotonic())
    m1.detach_ledger()
    assert "kvkeeper_up" not in {n for n, _ in samples(m1)}
    m1.attach_ledger(ledger)  # None: started now
    assert val(m1, "kvkeeper_up") == 1
    assert val(m1, "kvkeeper_start_time_seconds") == pytest.approx(time.time(), abs=5.0)


# ------------------------------------------------------------------ values follow the ledger
def test_values_follow_the_ledger():
    m, L = make(lease_ttl_s=1000.0, reservation_timeout_s=10.0)
    host = dict(tier="host")
    now = 1.0
    s = L.register_session("vllm-0", NS, now).id
    v = samples(m)
    assert val(v, "kvkeeper_sessions") == 1 and val(v, "kvkeeper_namespaces") == 1

    # reserve 3 blocks: pending, pinned
    rid = L.reserve(s, [key(0), key(1), key(2)], now).reservation_id
    v = samples(m)
    assert val(v, "kvkeeper_reservations") == 1
    assert val(v, "kvkeeper_tier_blocks", state="pending", **host) == 3
    assert val(v, "kvkeeper_tier_blocks", state="committed", **host) == 0
    assert val(v, "kvkeeper_tier_used_pages", **host) == 6
    assert val(v, "kvkeeper_tier_used_bytes", **host) == 6 * PAGE
    assert val(v, "kvkeeper_tier_pinned_bytes", **host) == 6 * PAGE
    assert val(v, "kvkeeper_tier_evictable_bytes", **host) == 0

    # commit: committed, evictable, saved counters
    L.commit(s, rid, now)
    v = samples(m)
    assert val(v, "kvkeeper_reservations") == 0
    assert val(v, "kvkeeper_tier_blocks", state="pending", **host) == 0
    assert val(v, "kvkeeper_tier_blocks", state="committed", **host) == 3
    assert val(v, "kvkeeper_saved_blocks_total", **host) == 3
    assert val(v, "kvkeeper_saved_bytes_total", **host) == 3 * NS.block_bytes
    assert val(v, "kvkeeper_tier_evictable_bytes", **host) == 6 * PAGE
    assert val(v, "kvkeeper_tier_pinned_bytes", **host) == 0

    # match with a lease: lookups, hits, leases, pinned
    res = L.match(s, [key(0), key(1), key(99)], lease=True, now=now)
    assert res.matched == 2
    v = samples(m)
    assert val(v, "kvkeeper_lookups_total") == 1
    assert val(v, "kvkeeper_lookup_keys_total") == 3
    assert val(v, "kvkeeper_hit_blocks_total", **host) == 2
    assert val(v, "kvkeeper_hit_tokens_total", **host) == 2 * NS.block_tokens
    # a Match without report_use: every key it names was asked of the daemon
    assert val(v, "kvkeeper_lookup_blocks_total") == 3
    assert val(v, "kvkeeper_lookup_tokens_total") == 3 * NS.block_tokens
    assert val(v, "kvkeeper_prompt_blocks_total") == 0
    assert val(v, "kvkeeper_leases") == 1
    assert val(v, "kvkeeper_tier_pinned_bytes", **host) == 4 * PAGE
    assert val(v, "kvkeeper_tier_evictable_bytes", **host) == 2 * PAGE

    # release with discard: evictions{reason="discarded"}
    L.release(s, res.lease_id, now, discard=True)
    v = samples(m)
    assert val(v, "kvkeeper_leases") == 0
    assert val(v, "kvkeeper_evictions_total", reason="discarded", **host) == 2
    assert val(v, "kvkeeper_tier_blocks", state="committed", **host) == 1
    assert val(v, "kvkeeper_tier_used_pages", **host) == 2

    # abort: evictions{reason="aborted"}
    rid = L.reserve(s, [key(3)], now).reservation_id
    L.abort(s, rid, now)
    assert val(m, "kvkeeper_evictions_total", reason="aborted", **host) == 1

    # reservation timeout
    L.reserve(s, [key(4)], now)
    L.expire(now + 20.0)
    v = samples(m)
    assert val(v, "kvkeeper_reservations_timed_out_total") == 1
    assert val(v, "kvkeeper_evictions_total", reason="reservation_timeout", **host) == 1
    assert val(v, "kvkeeper_reservations") == 0

    # capacity eviction: fill the tier, then one more block
    now = 30.0
    assert L.expire(now).thawed_pages == 2   # the timed-out reservation's pages (cooling.py)
    rid = L.reserve(s, [key(100 + i) for i in range(31)], now).reservation_id   # 62 pages + 2 held
    L.commit(s, rid, now)
    assert val(m, "kvkeeper_tier_used_pages", **host) == PAGES
    rid = L.reserve(s, [key(200)], now + 1).reservation_id
    L.commit(s, rid, now + 1)
    v = samples(m)
    assert val(v, "kvkeeper_evictions_total", reason="capacity", **host) == 1
    assert val(v, "kvkeeper_tier_blocks", state="committed", **host) == 32
    assert val(v, "kvkeeper_saved_blocks_total", **host) == 3 + 31 + 1

    # admin reclaim
    n = L.reclaim_unpinned()
    v = samples(m)
    assert val(v, "kvkeeper_evictions_total", reason="admin", **host) == n == 32
    assert val(v, "kvkeeper_tier_used_bytes", **host) == 0
    assert val(v, "kvkeeper_evictions_total", reason="demoted", **host) == 0

    # session expiry
    L.expire(now + 5000.0)
    v = samples(m)
    assert val(v, "kvkeeper_sessions_expired_total") == 1
    assert val(v, "kvkeeper_sessions_ended_total", reason="expired") == 1
    assert val(v, "kvkeeper_sessions_ended_total", reason="closed") == 0
    assert val(v, "kvkeeper_sessions") == 0
    L.check_invariants()


def test_observe_rpc_and_transfer():
    grpc = pytest.importorskip("grpc")
    m, _ = make()
    before = set(samples(m))
    m.observe_rpc("Match", 0.002, None)
    m.observe_rpc("Match", 0.004, "OK")
    m.observe_rpc("Match", 0.001, "NOT_FOUND")
    m.observe_rpc("Load", 0.5, grpc.StatusCode.RESOURCE_EXHAUSTED)
    m.observe_transfer("save", "shm", 3 * 8192, 0.0001)
    m.observe_transfer("load", "stream", 4096, 0.02)
    v = samples(m)
    assert set(v) == before, "observations must not create series"
    assert val(v, "kvkeeper_rpc_duration_seconds_count", method="Match") == 3
    assert val(v, "kvkeeper_rpc_duration_seconds_sum", method="Match") == pytest.approx(0.007)
    assert val(v, "kvkeeper_rpc_errors_total", method="Match", code="NOT_FOUND") == 1
    assert val(v, "kvkeeper_rpc_errors_total", method="Load", code="RESOURCE_EXHAUSTED") == 1
    assert val(v, "kvkeeper_rpc_duration_seconds_bucket", method="Load", le="0.25") == 0
    assert val(v, "kvkeeper_rpc_duration_seconds_bucket", method="Load", le="0.5") == 1
    assert val(v, "kvkeeper_transfer_bytes_total", direction="save", transport="shm") == 3 * 8192
    assert val(v, "kvkeeper_transfer_bytes_total", direction="load", transport="stream") == 4096
    assert val(v, "kvkeeper_transfer_duration_seconds_bucket", direction="save", transport="shm",
               le="0.0001") == 1
    assert val(v, "kvkeeper_transfer_duration_seconds_count", direction="load", transport="shm") == 0

    # A gRPC code outside the pre-created set is bounded and appears on first use.
    m.observe_rpc("Stats", 0.001, "UNIMPLEMENTED")
    assert val(m, "kvkeeper_rpc_errors_total", method="Stats", code="UNIMPLEMENTED") == 1


@pytest.mark.parametrize("call", [
    lambda m: m.observe_rpc("match", 0.1, None),
    lambda m: m.observe_rpc("Match", 0.1, "NOTFOUND"),
    lambda m: m.observe_rpc("Match", 0.1, "a3f0c9e1d2b4a5f6"),
    lambda m: m.observe_transfer("upload", "shm", 1, 0.1),
    lambda m: m.observe_transfer("save", "rdma", 1, 0.1),
    lambda m: m.observe_transfer("save", "shm", -1, 0.1),
])
def test_unknown_label_values_are_refused(call):
    m, _ = make()
    before = set(samples(m))
    with pytest.raises(ValueError):
        call(m)
    assert set(samples(m)) == before


# ------------------------------------------------------------------ label hygiene
HEXISH = re.compile(r"[0-9a-fA-F]{12,}")


def test_no_label_looks_like_a_key_hash_or_id():
    m, L = make()
    now = 1.0
    sessions = [L.register_session(f"instance-{i}", NS, now).id for i in range(3)]
    rid = L.reserve(sessions[0], [key(i) for i in range(5)], now).reservation_id
    L.commit(sessions[0], rid, now)
    res = L.match(sessions[1], [key(0), key(1)], lease=True, now=now)
    L.reserve(sessions[2], [key(50)], now)
    m.observe_rpc("Match", 0.001, "NOT_FOUND")
    m.observe_transfer("load", "shm", 8192, 0.001)
    assert res.lease_id is not None
    secrets = {str(sid) for sid in sessions} | {key(i).hex() for i in range(60)}
    text = m.render().decode()
    for secret in secrets:
        assert secret not in text
        assert secret.split("-", 1)[-1] not in text
    for (name, labels), _ in kv_samples(samples(m)).items():
        for label, value in labels:
            assert label in ALLOWED_LABELS, (name, label)
            assert len(value) <= 40, (name, label, value)
            assert not HEXISH.search(value), (name, label, value)


# ------------------------------------------------------------------ HTTP exporter
def test_http_endpoint_serves_on_port_zero():
    m, L = make()
    L.register_session("vllm-0", NS, 1.0)
    exporter = m.start_http("127.0.0.1:0")
    try:
        assert exporter.port > 0
        with urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=5) as r:
            assert r.status == 200
            assert r.headers["Content-Type"].startswith("text/plain")
            body = r.read().decode()
        assert "kvkeeper_up 1.0" in body
        assert "kvkeeper_sessions 1.0" in body
    finally:
        exporter.close()
    exporter.close()  # idempotent
    with pytest.raises((urllib.error.URLError, ConnectionError, OSError)):
        urllib.request.urlopen(f"http://127.0.0.1:{exporter.port}/metrics", timeout=2)


# The metrics listener's address goes through the project's one host:port parser.
@pytest.mark.parametrize("address,expected", [
    ("127.0.0.1:9400", ("127.0.0.1", 9400)),
    ("[::1]:0", ("::1", 0)),
    ("localhost:0", ("localhost", 0)),
])
def test_parse_address(address, expected):
    assert parse_host_port(address, any_port=True) == expected


@pytest.mark.parametrize("address", ["9400", "host:", "host:http", "host:70000", ":9400"])
def test_parse_address_refuses(address):
    with pytest.raises(ValueError):
        parse_host_port(address, any_port=True)
    with pytest.raises(ValueError, match="metrics address"):
        Metrics(registry=CollectorRegistry()).start_http(address)


# ------------------------------------------------------------------ thread safety
def test_scrapes_from_another_thread_while_the_ledger_changes():
    """The exporter thread reads while the loop thread mutates: no iteration errors."""
    m, L = make(lease_ttl_s=1e9)
    errors: list[BaseException] = []
    stop = threading.Event()

    def scrape() -> None:
        try:
            while not stop.is_set():
                m.render()
        except BaseException as e:  # pragma: no cover - the failure being tested for
            errors.append(e)

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    t = threading.Thread(target=scrape)
    t.start()
    try:
        now = 1.0
        for i in range(400):
            ns = NamespaceDescriptor(model_id=f"m{i}", block_tokens=16, block_bytes=PAGE)
            sid = L.register_session(f"i{i}", ns, now).id
            r = L.reserve(sid, [key(i * 10 + j) for j in range(3)], now)
            L.commit(sid, r.reservation_id, now)
            mr = L.match(sid, [key(i * 10)], lease=True, now=now)
            L.release(sid, mr.lease_id, now, discard=(i % 2 == 0))
            if i % 3 == 0:
                L.close_session(sid, now)
    finally:
        stop.set()
        t.join(timeout=10)
        sys.setswitchinterval(old)
    assert not errors, errors
    L.check_invariants()


# ------------------------------------------------------------------ promtool
def test_promtool_check_metrics():
    promtool = shutil.which("promtool")
    if promtool is None:
        if os.environ.get("CI"):
            pytest.fail("promtool missing: .ci/run must install prometheus")
        pytest.skip("promtool not installed (apt-get install prometheus)")
    m, L = make()
    s = L.register_session("vllm-0", NS, 1.0).id
    rid = L.reserve(s, [key(0)], 1.0).reservation_id
    L.commit(s, rid, 1.0)
    L.match(s, [key(0)], lease=False, now=1.0)
    m.observe_rpc("Match", 0.001, "NOT_FOUND")
    m.observe_transfer("save", "stream", 8192, 0.003)
    text = m.render()
    proc = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True,
                          timeout=60)
    assert proc.returncode == 0, proc.stdout.decode() + proc.stderr.decode()
    # promtool prints lint problems even when it exits 0 in some versions.
    assert not proc.stdout.strip() and not proc.stderr.strip(), (proc.stdout + proc.stderr).decode()


def test_admission_refusals_are_counted_per_tier():
    """Host: a long run of fresh keys that would evict is not admitted (s3fifo);
    disk: a never-hit copy bound for a full book, the first time it comes."""
    m, L = make()
    assert L.config.policy == "s3fifo"
    s = L.register_session("vllm-0", NS, 1.0).id
    for start in range(0, 32, 8):            # fill the tier in runs short enough to be admitted
        L.commit(s, L.reserve(s, [key(i) for i in range(start, start + 8)], 1.0).reservation_id, 1.0)
    assert L.top.free_pages == 0
    r = L.reserve(s, [key(100 + i) for i in range(20)], 2.0)
    assert r.reservation_id is None and set(r.statuses) == {"not-admitted"}
    book = L.add_book("disk", 2 * PAGE)
    book.written(book.reserve(b"n", key(0), 2 * PAGE).entry)
    assert book.reserve(b"n", key(1), 2 * PAGE) is None
    v = samples(m)
    assert val(v, "kvkeeper_admission_refused_total", tier="host") == 20
    assert val(v, "kvkeeper_admission_refused_total", tier="disk") == 1
    assert val(v, "kvkeeper_evictions_total", tier="host", reason="capacity") == 0
    L.check_invariants()


def test_a_last_turns_release_counts_the_blocks_it_demoted():
    """Release(last_turn) demotes the lease's blocks nobody else pins: counted
    on the tier that holds them, and their disk copies go first in the disk
    book's order too; the blocks another lease pins are not demoted."""
    m, L = make()
    book = L.add_book("disk", 16 * PAGE)
    s = L.register_session("vllm-0", NS, 1.0).id
    ns = L.namespaces[next(iter(L.namespaces))]
    for i in range(6):
        L.commit(s, L.reserve(s, [key(i)], 1.0).reservation_id, 1.0)
        book.written(book.reserve(ns.id, key(i), 2 * PAGE).entry)
    other = L.match(s, [key(0), key(1)], lease=True, now=2.0).lease_id
    last = L.match(s, [key(i) for i in range(4)], lease=True, now=2.0).lease_id
    L.release(s, last, 3.0, last_turn=True)
    assert val(m, "kvkeeper_last_turn_blocks_total", tier="host") == 2
    assert val(m, "kvkeeper_last_turn_blocks_total", tier="disk") == 2
    assert {e.where[1] for e in book.eviction_order()[:2]} == {key(2), key(3)}
    L.release(s, other, 3.0)
    assert val(m, "kvkeeper_last_turn_blocks_total", tier="host") == 2
    L.check_invariants()
    book.check_invariants()
