"""deploy/docker: what can be checked without a Docker daemon. The Dockerfiles'
COPY sources exist and build the wheel, the image's config loads and agrees with
EXPOSE, VOLUME and compose.yaml, compose.yaml is consistent (paths, ports,
volumes, shared memory, the connector's config), and the HEALTHCHECK probe
tells SERVING from anything else against a real daemon."""
from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path
from typing import Any, Iterator

import pytest
from deploy_support import (
    DEPLOY,
    ROOT,
    clean_env,
    free_port,
    serve_args,
    socket_accepts,
    stop,
    wait_until,
)
from kvkeeper.server.security.auth import check_exposure
from kvkeeper.server.config import load_config, parse_size

yaml = pytest.importorskip("yaml")

DOCKER = DEPLOY / "docker"
COMPOSE = DOCKER / "compose.yaml"
DOCKERFILES = {"kvkeeper": DOCKER / "Dockerfile", "vllm": DOCKER / "vllm.Dockerfile"}
IMAGE_CONFIG = DOCKER / "kvkeeper.toml"
HEALTHCHECK = DOCKER / "healthcheck.py"


# --------------------------------------------------------------------------- Dockerfile parsing
def instructions(path: Path) -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) with continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    buf = ""
    for raw in path.read_text().splitlines():
        line = raw.strip()
        if not buf and (not line or line.startswith("#")):
            continue
        if line.startswith("#"):
            continue  # a comment inside a continued instruction
        if line.endswith("\\"):
            buf += line[:-1] + " "
            continue
        buf += line
        word, _, rest = buf.partition(" ")
        out.append((word.upper(), rest.strip()))
        buf = ""
    assert not buf, f"{path}: dangling line continuation"
    return out


def stages(path: Path) -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions(path):
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def build_args(path: Path) -> dict[str, str]:
    """Global ARG defaults (before the first FROM)."""
    args: dict[str, str] = {}
    for word, rest in instructions(path):
        if word == "FROM":
            break
        if word == "ARG" and "=" in rest:
            k, _, v = rest.partition("=")
            args[k] = v
    return args


def copy_sources(stage: list[tuple[str, str]]) -> list[tuple[list[str], str]]:
    """([sources], destination) of each COPY/ADD from the build context (not --from)."""
    out = []
    for word, rest in stage:
        if word not in ("COPY", "ADD"):
            continue
        parts = shlex.split(rest)
        flags = [p for p in parts if p.startswith("--")]
        if any(f.startswith("--from") for f in flags):
            continue
        args = [p for p in parts if not p.startswith("--")]
        out.append((args[:-1], args[-1]))
    return out


def compose() -> dict[str, Any]:
    return yaml.safe_load(COMPOSE.read_text())


def image_config():
    return load_config(str(IMAGE_CONFIG), env={})


# --------------------------------------------------------------------------- Dockerfiles
@pytest.mark.parametrize("name", sorted(DOCKERFILES))
def test_copy_sources_exist_in_the_build_context(name: str) -> None:
    """compose builds with context ../.. (the repository root); every COPY source is there."""
    path = DOCKERFILES[name]
    service = compose()["services"][name]["build"]
    context = (COMPOSE.parent / service["context"]).resolve()
    assert context == ROOT
    assert (context / service["dockerfile"]).resolve() == path.resolve()
    ignore = (path.parent / (path.name + ".dockerignore")).read_text().split()
    seen = 0
    for stage in stages(path):
        for sources, _ in copy_sources(stage):
            for src in sources:
                assert (context / src).exists(), f"{path.name}: COPY {src} does not exist"
                assert not any(src.rstrip("/") == pat.rstrip("/") for pat in ignore), \
                    f"{path.name}: COPY {src} is excluded by its .dockerignore"
                seen += 1
    assert seen >= 5


def test_kvkeeper_image_shape() -> None:
    path = DOCKERFILES["kvkeeper"]
    st = stages(path)
    assert len(st) >= 2, "multi-stage: a builder and a runtime stage"
    args = build_args(path)
    assert args["PYTHON_IMAGE"] == "python:3.11-slim"
    assert st[0][0][1] == "${PYTHON_IMAGE} AS builder"
    runtime = st[-1]
    assert runtime[0][1] == "${PYTHON_IMAGE}"
    words = {w for w, _ in runtime}
    assert {"USER", "EXPOSE", "HEALTHCHECK", "ENTRYPOINT", "CMD", "VOLUME"} <= words
    [user] = [r for w, r in runtime if w == "USER"]
    assert user not in ("root", "0")
    assert "useradd --system" in " ".join(r for w, r in runtime if w == "RUN")
    [expose] = [r for w, r in runtime if w == "EXPOSE"]
    assert expose.split() == ["50051", "9464"]
    # The builder makes the wheels; the runtime installs them offline.
    assert any("pip wheel --wheel-dir /wheels ." in r for w, r in st[0] if w == "RUN")
    assert any("--no-index --find-links /wheels kvkeeper" in r for w, r in runtime if w == "RUN")
    # The health probe is copied where HEALTHCHECK runs it.
    copies = {dst: srcs for srcs, dst in copy_sources(runtime)}
    [hc] = [r for w, r in runtime if w == "HEALTHCHECK"]
    probe = next(dst for dst, srcs in copies.items() if srcs == ["deploy/docker/healthcheck.py"])
    assert probe in hc and "CMD" in hc
    assert copies["/etc/kvkeeper/kvkeeper.toml"] == ["deploy/docker/kvkeeper.toml"]
    env = " ".join(r for w, r in runtime if w == "ENV")
    assert "KVKEEPER_CONFIG=/etc/kvkeeper/kvkeeper.toml" in env
    assert json.loads([r for w, r in runtime if w == "ENTRYPOINT"][0]) == ["kvkeeper"]
    assert json.loads([r for w, r in runtime if w == "CMD"][0]) == ["serve"]


def test_image_config_agrees_with_expose_volume_and_compose() -> None:
    cfg = image_config()
    runtime = stages(DOCKERFILES["kvkeeper"])[-1]
    expose = [r for w, r in runtime if w == "EXPOSE"][0].split()
    assert cfg.listen.tcp.rsplit(":", 1)[1] in expose
    assert cfg.metrics.address.rsplit(":", 1)[1] in expose
    [volume] = [json.loads(r) for w, r in runtime if w == "VOLUME"]
    assert volume == [os.path.dirname(cfg.listen.socket)]
    assert cfg.host_tier.shm_dir == "/dev/shm"
    assert cfg.server.grace_seconds < 30
    check_exposure(cfg, None)  # the image starts: its 0.0.0.0 listener is allowed explicitly


def test_builder_copy_set_builds_the_wheel(tmp_path: Path) -> None:
    """Replay the builder stage's COPY lines into an empty directory and build the
    wheel from it: nothing the build needs is left out of the image."""
    pytest.importorskip("setuptools")
    pytest.importorskip("wheel")
    src = tmp_path / "src"
    src.mkdir()
    builder = stages(DOCKERFILES["kvkeeper"])[0]
    assert ("WORKDIR", "/src") in builder
    for sources, dst in copy_sources(builder):
        for s in sources:
            # Docker: a destination ending in "/" (or ".") is a directory to copy into.
            target = src / dst / Path(s).name if dst.endswith(("/", ".")) else src / dst
            if (ROOT / s).is_dir():
                shutil.copytree(ROOT / s, target, dirs_exist_ok=True,
                                ignore=shutil.ignore_patterns("__pycache__"))
            else:
                target.parent.mkdir(parents=True, exist_ok=True)
                shutil.copy(ROOT / s, target)
    # The vLLM image's builder copies the same set.
    assert copy_sources(stages(DOCKERFILES["vllm"])[0]) == copy_sources(builder)
    out = tmp_path / "wheels"
    r = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation",
                        "-q", "-w", str(out), str(src)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout + r.stderr
    wheel = next(out.glob("kvkeeper-*-py3-none-any.whl"))
    names = zipfile.ZipFile(wheel).namelist()
    for module in ("kvkeeper/server/cli/__main__.py", "kvkeeper/server/ops/sdnotify.py",
                   "kvkeeper/v1/kvkeeper_pb2_grpc.py", "kvkeeper/connector/__init__.py",
                   "kvkeeper/client/aio.py"):
        assert module in names, module


# --------------------------------------------------------------------------- compose.yaml
def test_compose_services_and_named_volumes() -> None:
    c = compose()
    assert set(c["services"]) == {"kvkeeper", "vllm", "prometheus", "grafana", "valkey"}
    declared = set(c.get("volumes") or {})
    used = set()
    for name, svc in c["services"].items():
        for v in svc.get("volumes", []):
            src, dst = v.split(":")[:2]
            if src.startswith((".", "/")):
                assert (COMPOSE.parent / src).exists(), f"{name}: bind source {src} missing"
            else:
                used.add(src)
            assert dst.startswith("/"), v
    assert used == declared, (used, declared)


def test_compose_shared_memory_and_socket() -> None:
    c = compose()
    cfg = image_config()
    kv, vllm = c["services"]["kvkeeper"], c["services"]["vllm"]
    # vLLM joins kvkeeper's IPC namespace, hence its /dev/shm, where the arena is.
    assert kv["ipc"] == "shareable"
    assert vllm["ipc"] == "service:kvkeeper"
    assert "shm_size" not in vllm, "a joined container uses kvkeeper's /dev/shm"
    shm = parse_size(str(kv["shm_size"]).replace("gb", "GiB").replace("mb", "MiB"))
    assert shm > cfg.host_tier.capacity_bytes, (kv["shm_size"], cfg.host_tier.capacity_bytes)
    assert shm - cfg.host_tier.capacity_bytes >= 1 << 30, "headroom for vLLM's own /dev/shm use"
    # The socket's directory is one named volume mounted in both.
    sockdir = os.path.dirname(cfg.listen.socket)
    mounts = {name: {v.split(":")[1]: v.split(":")[0] for v in svc.get("volumes", [])}
              for name, svc in c["services"].items()}
    assert mounts["kvkeeper"][sockdir] == mounts["vllm"][sockdir] == "kvkeeper-run"
    assert kv["ulimits"]["memlock"] == {"soft": -1, "hard": -1}
    assert parse_stop(kv["stop_grace_period"]) > cfg.server.grace_seconds


def parse_stop(text: str) -> float:
    m = re.fullmatch(r"(\d+)s", text)
    assert m, text
    return float(m.group(1))


def test_compose_vllm_uses_the_connector() -> None:
    c = compose()
    vllm = c["services"]["vllm"]
    assert vllm["entrypoint"] == ["vllm", "serve"]
    cmd = vllm["command"]
    kv = json.loads(cmd[cmd.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "KVKeeperConnector"
    assert kv["kv_connector_module_path"] == "kvkeeper.connector"
    assert kv["kv_role"] == "kv_both"
    url = kv["kv_connector_extra_config"]["kvkeeper_url"]
    assert url == "unix://" + image_config().listen.socket
    assert vllm["depends_on"]["kvkeeper"]["condition"] == "service_healthy"
    # The connector accepts the extra config as written (its own parser, no vLLM needed).
    config_mod = pytest.importorskip("kvkeeper.connector.config")
    parsed = config_mod.ConnectorConfig.from_extra(kv["kv_connector_extra_config"],
                                                   kv_role=kv["kv_role"], env={})
    assert parsed.url == url and parsed.load and parsed.save
    # The vLLM image installs kvkeeper with the vllm extra.
    assert "[vllm]" in DOCKERFILES["vllm"].read_text()


def test_compose_ports_match_the_configs() -> None:
    c = compose()
    cfg = image_config()
    published = {}
    for name, svc in c["services"].items():
        for p in svc.get("ports", []):
            host_ip, host_port, container_port = p.split(":")
            assert host_ip == "127.0.0.1", f"{name} publishes {p} beyond loopback"
            published[(name, int(container_port))] = int(host_port)
    assert ("kvkeeper", int(cfg.listen.tcp.rsplit(":", 1)[1])) in published
    assert ("kvkeeper", int(cfg.metrics.address.rsplit(":", 1)[1])) in published
    assert ("vllm", 8000) in published and ("prometheus", 9090) in published
    assert ("grafana", 3000) in published
    # Prometheus scrapes the services by their compose names and container ports.
    prom = yaml.safe_load((DEPLOY / "prometheus/prometheus.yml").read_text())
    targets = {j["job_name"]: [t for sc in j["static_configs"] for t in sc["targets"]]
               for j in prom["scrape_configs"]}
    assert targets["kvkeeper"] == [f"kvkeeper:{cfg.metrics.address.rsplit(':', 1)[1]}"]
    assert targets["vllm"] == ["vllm:8000"]
    # The Prometheus container reads this folder as /etc/prometheus.
    pv = {v.split(":")[1]: v.split(":")[0] for v in c["services"]["prometheus"]["volumes"]}
    assert (COMPOSE.parent / pv["/etc/prometheus"]).resolve() == (DEPLOY / "prometheus").resolve()
    assert "--config.file=/etc/prometheus/prometheus.yml" in c["services"]["prometheus"]["command"]


def test_compose_grafana_provisioning_paths() -> None:
    c = compose()
    g = c["services"]["grafana"]
    mounts = {v.split(":")[1]: (COMPOSE.parent / v.split(":")[0]).resolve()
              for v in g["volumes"] if v.startswith(".")}
    prov = mounts["/etc/grafana/provisioning"]
    assert prov == (DEPLOY / "grafana/provisioning").resolve()
    ds = yaml.safe_load((prov / "datasources/prometheus.yml").read_text())
    [source] = ds["datasources"]
    assert source["type"] == "prometheus" and source["url"] == "http://prometheus:9090"
    providers = yaml.safe_load((prov / "dashboards/kvkeeper.yml").read_text())["providers"]
    [provider] = providers
    path = provider["options"]["path"]
    assert mounts[path] == (DEPLOY / "grafana/dashboards").resolve()
    home = g["environment"]["GF_DASHBOARDS_DEFAULT_HOME_DASHBOARD_PATH"]
    assert home.startswith(path + "/")
    assert (DEPLOY / "grafana/dashboards" / os.path.basename(home)).is_file()


@pytest.mark.skipif(shutil.which("docker") is None, reason="no docker CLI")
def test_compose_config_if_the_compose_plugin_exists() -> None:
    probe = subprocess.run(["docker", "compose", "version"], capture_output=True, text=True)
    if probe.returncode != 0:
        pytest.skip("docker compose plugin not installed")
    r = subprocess.run(["docker", "compose", "-f", str(COMPOSE), "config", "--quiet"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr


# --------------------------------------------------------------------------- the health probe
@pytest.fixture
def shortdir() -> Iterator[Path]:
    d = Path(tempfile.mkdtemp(prefix="kvkh-", dir="/tmp"))
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def probe(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTHCHECK), *args], capture_output=True,
                          text=True, timeout=30, env=env or clean_env())


def test_probe_says_healthy_for_a_serving_daemon(shortdir: Path) -> None:
    sock = shortdir / "kvk.sock"
    port = free_port()
    proc = subprocess.Popen(serve_args(sock, tcp=f"127.0.0.1:{port}"), stderr=subprocess.PIPE,
                            text=True, env=clean_env())
    try:
        wait_until(lambda: socket_accepts(sock), 30, "the daemon's socket", proc)
        r = probe(f"unix://{sock}")
        assert r.returncode == 0 and r.stdout.startswith("healthy: "), r.stdout + r.stderr
        assert "SERVING" in r.stdout
        r = probe(f"127.0.0.1:{port}")
        assert r.returncode == 0, r.stdout + r.stderr
        # $KVKEEPER_URL, as the image sets it, is the default target.
        r = probe(env=clean_env(KVKEEPER_URL=f"unix://{sock}"))
        assert r.returncode == 0, r.stdout + r.stderr
    finally:
        rc, err = stop(proc)
    assert rc == 0, err
    r = probe(f"unix://{sock}")
    assert r.returncode == 1 and "no socket" in r.stdout, r.stdout


def test_probe_says_unhealthy_when_nothing_listens(shortdir: Path) -> None:
    r = probe(f"unix://{shortdir}/absent.sock")
    assert r.returncode == 1 and r.stdout.startswith("unhealthy: "), r.stdout
    r = probe(f"127.0.0.1:{free_port()}", "--timeout", "1")
    assert r.returncode == 1 and "UNAVAILABLE" in r.stdout, r.stdout


def test_probe_says_unhealthy_when_not_serving(shortdir: Path) -> None:
    """A daemon that is draining answers NOT_SERVING: that must fail the probe."""
    grpc = pytest.importorskip("grpc")
    from concurrent import futures

    from grpc_health.v1 import health, health_pb2, health_pb2_grpc

    server = grpc.server(futures.ThreadPoolExecutor(max_workers=2))
    servicer = health.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(servicer, server)
    sock = shortdir / "h.sock"
    server.add_insecure_port(f"unix:{sock}")
    server.start()
    try:
        servicer.set("", health_pb2.HealthCheckResponse.SERVING)
        assert probe(f"unix://{sock}").returncode == 0
        servicer.enter_graceful_shutdown()
        r = probe(f"unix://{sock}")
        assert r.returncode == 1 and "NOT_SERVING" in r.stdout, r.stdout
    finally:
        server.stop(0)
