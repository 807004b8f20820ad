"""deploy/kubernetes, offline. Every manifest validates against the Kubernetes
schemas that kubernetes-validate bundles (strict: unknown fields fail), the
ServiceMonitor against a vendored subset of prometheus-operator's CRD; the
pieces agree with each other, with the daemon's own config loader and
start-up checks, and with deploy/docker (image, user, probe, entrypoints);
the daemon serves with the ConfigMap's config and the DaemonSet's probe
command tells it from a stopped one; the init container's command works with
exactly the capabilities it is given."""
from __future__ import annotations

import copy
import functools
import json
import os
import re
import shutil
import stat
import subprocess
import sys
import urllib.request
import uuid
from pathlib import Path
from typing import Any

import jsonschema
import kubernetes_validate
import pytest
from deploy_support import DEPLOY, KVKEEPER, clean_env, free_port, socket_accepts, stop, wait_until
from kvkeeper.server.security.auth import check_exposure
from kvkeeper.server.config import Config, load_config

yaml = pytest.importorskip("yaml")

K8S = DEPLOY / "kubernetes"
KUSTOMIZATION = K8S / "kustomization.yaml"
EXAMPLE = K8S / "vllm-example.yaml"
DOCKERFILE = DEPLOY / "docker" / "Dockerfile"
VLLM_DOCKERFILE = DEPLOY / "docker" / "vllm.Dockerfile"
SERVICEMONITOR_SCHEMA = Path(__file__).with_name("servicemonitor.schema.json")
# The oldest Kubernetes the manifests are checked against, and the newest bundled.
K8S_VERSIONS = ("1.29", kubernetes_validate.latest_version())
# Kinds outside the core schemas, and what checks them instead.
NON_CORE = {("monitoring.coreos.com/v1", "ServiceMonitor")}


# --------------------------------------------------------------------------- loading
def manifests(path: Path) -> list[dict[str, Any]]:
    return [d for d in yaml.safe_load_all(path.read_text()) if d]


@functools.lru_cache(maxsize=None)
def all_documents() -> tuple[tuple[str, int, dict[str, Any]], ...]:
    """(file name, index, object) of every Kubernetes object in deploy/kubernetes (shared:
    tests deep-copy what they change)."""
    out = []
    for path in sorted(K8S.glob("*.yaml")):
        if path != KUSTOMIZATION:
            out += [(path.name, i, d) for i, d in enumerate(manifests(path))]
    return tuple(out)


def one(kind: str, name: str) -> dict[str, Any]:
    [obj] = [d for _, _, d in all_documents() if d["kind"] == kind and d["metadata"]["name"] == name]
    return obj


def daemonset() -> dict[str, Any]:
    return one("DaemonSet", "kvkeeper")


def engine() -> dict[str, Any]:
    return one("Deployment", "vllm")


def container(workload: dict[str, Any], name: str, init: bool = False) -> dict[str, Any]:
    spec = workload["spec"]["template"]["spec"]
    [c] = [c for c in spec["initContainers" if init else "containers"] if c["name"] == name]
    return c


def volume_at(workload: dict[str, Any], c: dict[str, Any], path: str) -> dict[str, Any]:
    """The pod volume that container `c` mounts at `path`."""
    [mount] = [m for m in c.get("volumeMounts", []) if m["mountPath"] == path]
    [vol] = [v for v in workload["spec"]["template"]["spec"]["volumes"] if v["name"] == mount["name"]]
    return {**vol, "readOnly": mount.get("readOnly", False)}


def literal_env(c: dict[str, Any]) -> dict[str, str]:
    return {e["name"]: e["value"] for e in c.get("env", []) if "value" in e}


def daemon_config(tmp_path: Path) -> Config:
    """The ConfigMap's TOML through the daemon's loader, with the container's environment."""
    ds, cm = daemonset(), one("ConfigMap", "kvkeeper-config")
    env = literal_env(container(ds, "kvkeeper"))
    path = env["KVKEEPER_CONFIG"]
    config_vol = volume_at(ds, container(ds, "kvkeeper"), os.path.dirname(path))
    assert config_vol["configMap"]["name"] == cm["metadata"]["name"] and config_vol["readOnly"]
    toml = tmp_path / os.path.basename(path)
    toml.write_text(cm["data"][os.path.basename(path)])
    return load_config(str(toml), env={**env, "KVKEEPER_CONFIG": str(toml)})


def quantity(text: Any) -> int:
    """Bytes of a Kubernetes quantity such as 10Gi, 512Mi, 1G or 1000."""
    m = re.fullmatch(r"(\d+)(Ki|Mi|Gi|Ti|k|M|G|T)?", str(text))
    assert m, f"not a quantity this test reads: {text!r}"
    scale = {None: 1, "Ki": 2**10, "Mi": 2**20, "Gi": 2**30, "Ti": 2**40,
             "k": 10**3, "M": 10**6, "G": 10**9, "T": 10**12}[m.group(2)]
    return int(m.group(1)) * scale


def dockerfile(path: Path, pattern: str) -> list[str]:
    return re.findall(pattern, path.read_text(), re.MULTILINE)


def image_uid() -> int:
    [uid] = dockerfile(DOCKERFILE, r"^ARG KVKEEPER_UID=(\d+)$")
    assert dockerfile(DOCKERFILE, r'groupadd --system --gid "\$\{KVKEEPER_UID\}" kvkeeper')
    assert dockerfile(DOCKERFILE, r'useradd --system --uid "\$\{KVKEEPER_UID\}" --gid kvkeeper')
    return int(uid)


def selects(selector: dict[str, str], labels: dict[str, str]) -> bool:
    return bool(selector) and all(labels.get(k) == v for k, v in selector.items())


# --------------------------------------------------------------------------- schemas
def check_schema(doc: dict[str, Any], version: str) -> None:
    """ValidationError (or SchemaNotFoundError for a kind nobody checks) unless `doc` is valid."""
    if (doc["apiVersion"], doc["kind"]) in NON_CORE:
        jsonschema.Draft202012Validator(json.loads(SERVICEMONITOR_SCHEMA.read_text())).validate(doc)
    else:
        kubernetes_validate.validate(doc, version, strict=True)


@pytest.mark.parametrize("version", K8S_VERSIONS)
@pytest.mark.parametrize("where", [f"{f}#{i}" for f, i, _ in all_documents()])
def test_every_manifest_validates(where: str, version: str) -> None:
    [doc] = [d for f, i, d in all_documents() if f"{f}#{i}" == where]
    check_schema(doc, version)


def test_the_schema_checks_catch_mistakes() -> None:
    """A misspelt field, a wrong type or a missing required field fails, in both checkers."""
    version = K8S_VERSIONS[-1]
    bad = copy.deepcopy(daemonset())
    bad["spec"]["template"]["spec"]["containers"][0]["readinesProbe"] = {}
    with pytest.raises(jsonschema.ValidationError, match="readinesProbe"):
        check_schema(bad, version)
    bad = copy.deepcopy(one("Service", "kvkeeper-metrics"))
    bad["spec"]["ports"][0]["port"] = "9464"
    with pytest.raises(jsonschema.ValidationError, match="integer"):
        check_schema(bad, version)
    sm = one("ServiceMonitor", "kvkeeper")
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["interval"] = "15 seconds"
    with pytest.raises(jsonschema.ValidationError):
        check_schema(bad, version)
    bad = copy.deepcopy(sm)
    bad["spec"]["endpoints"][0]["ports"] = bad["spec"]["endpoints"][0].pop("port")
    with pytest.raises(jsonschema.ValidationError, match="ports"):
        check_schema(bad, version)
    bad = copy.deepcopy(sm)
    del bad["spec"]["selector"]
    with pytest.raises(jsonschema.ValidationError, match="selector"):
        check_schema(bad, version)
    with pytest.raises(kubernetes_validate.SchemaNotFoundError):
        check_schema({"apiVersion": "example.com/v1", "kind": "Unknown", "metadata": {"name": "x"}},
                     version)


def test_the_pieces_are_all_there() -> None:
    kinds = sorted((d["kind"], d["metadata"]["name"]) for _, _, d in all_documents())
    assert kinds == [("ConfigMap", "kvkeeper-config"), ("DaemonSet", "kvkeeper"),
                     ("Deployment", "vllm"), ("Namespace", "kvkeeper"),
                     ("Service", "kvkeeper-metrics"), ("Service", "vllm"),
                     ("ServiceMonitor", "kvkeeper")]


# --------------------------------------------------------------------------- the daemon
def test_configmap_config_loads_and_passes_the_start_up_checks(tmp_path: Path) -> None:
    cfg = daemon_config(tmp_path)
    check_exposure(cfg, None)  # what the daemon refuses at start-up (a bare non-loopback TCP)
    assert cfg.listen.socket == "/run/kvkeeper/kvkeeper.sock"
    assert cfg.listen.socket_mode & 0o060 == 0o060 and cfg.listen.socket_mode & 0o007 == 0
    assert cfg.metrics.address.rsplit(":", 1)[0] == "0.0.0.0", "Prometheus scrapes the pod IP"
    assert cfg.host_tier.name, "a fixed arena name: a restart replaces the old file"
    # Every KVKEEPER_<SECTION>_* variable of the container names a real key (load_config raised).
    assert cfg.source_of("host_tier.capacity_bytes").startswith("config file")


def test_daemonset_mounts_agree_with_the_config(tmp_path: Path) -> None:
    cfg, ds = daemon_config(tmp_path), daemonset()
    main, init = container(ds, "kvkeeper"), container(ds, "host-dirs", init=True)
    sock_dir, shm_dir = os.path.dirname(cfg.listen.socket), cfg.host_tier.shm_dir
    host_dirs = []
    for path in (sock_dir, shm_dir):
        vol = volume_at(ds, main, path)
        # The same path on the node and in every pod: clients open the paths the daemon names.
        assert vol["hostPath"] == {"path": path, "type": "DirectoryOrCreate"}, vol
        assert not vol["readOnly"]
        assert volume_at(ds, init, path)["name"] == vol["name"]
        host_dirs.append(path)
    spec = ds["spec"]["template"]["spec"]
    assert sorted(v["hostPath"]["path"] for v in spec["volumes"] if "hostPath" in v) == sorted(host_dirs)
    uid = image_uid()
    assert init["command"] == ["install", "-d", "-o", str(uid), "-g", str(uid), "-m", "0750",
                               *host_dirs]
    assert main["args"] == json.loads(dockerfile(DOCKERFILE, r"^CMD (\[.*\])$")[-1])


def test_daemonset_probes_ask_grpc_health_on_the_socket(tmp_path: Path) -> None:
    cfg, main = daemon_config(tmp_path), container(daemonset(), "kvkeeper")
    [probe_path] = dockerfile(DOCKERFILE, r"^COPY deploy/docker/healthcheck\.py (\S+)$")
    for kind in ("startupProbe", "readinessProbe", "livenessProbe"):
        probe = main[kind]
        cmd = probe["exec"]["command"]
        assert cmd[:3] == ["python", probe_path, "unix://" + cfg.listen.socket], (kind, cmd)
        timeout = float(cmd[cmd.index("--timeout") + 1])
        assert probe["timeoutSeconds"] > timeout, f"{kind}: the kubelet must outwait the probe"


def test_metrics_service_and_servicemonitor(tmp_path: Path) -> None:
    cfg, ds = daemon_config(tmp_path), daemonset()
    svc, sm = one("Service", "kvkeeper-metrics"), one("ServiceMonitor", "kvkeeper")
    template_labels = ds["spec"]["template"]["metadata"]["labels"]
    assert selects(ds["spec"]["selector"]["matchLabels"], template_labels)
    assert selects(svc["spec"]["selector"], template_labels)
    assert svc["spec"]["clusterIP"] == "None", "headless: every daemon is a target of its own"
    metrics_port = int(cfg.metrics.address.rsplit(":", 1)[1])
    ports = {p["name"]: p for p in container(ds, "kvkeeper")["ports"]}
    [sp] = svc["spec"]["ports"]
    assert ports[sp["targetPort"]]["containerPort"] == metrics_port == sp["port"]
    # The ServiceMonitor finds the Service, names a port it has, and sets the job the rules select.
    assert sm["apiVersion"] == "monitoring.coreos.com/v1"
    assert selects(sm["spec"]["selector"]["matchLabels"], svc["metadata"]["labels"])
    [ep] = sm["spec"]["endpoints"]
    assert ep["port"] == sp["name"] and ep["path"] == "/metrics"
    job = svc["metadata"]["labels"][sm["spec"]["jobLabel"]]
    rules = (DEPLOY / "prometheus/rules/kvkeeper.rules.yml").read_text()
    assert set(re.findall(r'job="([^"]+)"', rules)) == {job}


def test_daemonset_runs_without_root(tmp_path: Path) -> None:
    cfg, ds = daemon_config(tmp_path), daemonset()
    spec, uid = ds["spec"]["template"]["spec"], image_uid()
    assert spec["securityContext"]["runAsNonRoot"] is True
    assert spec["securityContext"]["runAsUser"] == spec["securityContext"]["runAsGroup"] == uid
    assert spec["securityContext"]["seccompProfile"] == {"type": "RuntimeDefault"}
    for key in ("hostIPC", "hostNetwork", "hostPID"):
        assert not spec.get(key), key
    assert spec["automountServiceAccountToken"] is False
    sc = container(ds, "kvkeeper")["securityContext"]
    assert sc["runAsNonRoot"] is True and sc["runAsUser"] == uid and sc["runAsGroup"] == uid
    assert sc["readOnlyRootFilesystem"] is True and sc["allowPrivilegeEscalation"] is False
    assert sc["capabilities"] == {"drop": ["ALL"]} and not sc.get("privileged")
    # The daemon is a member of the socket's group (access.resolve_group checks it at start-up).
    assert cfg.listen.socket_group == str(uid)
    # Only the init container is root, with the two capabilities chown and chmod need.
    isc = container(ds, "host-dirs", init=True)["securityContext"]
    assert isc["runAsUser"] == 0 and isc["allowPrivilegeEscalation"] is False
    assert isc["capabilities"]["drop"] == ["ALL"] and sorted(isc["capabilities"]["add"]) == ["CHOWN", "FOWNER"]
    assert isc["readOnlyRootFilesystem"] is True and not isc.get("privileged")
    assert spec["terminationGracePeriodSeconds"] > cfg.server.grace_seconds
    limits = container(ds, "kvkeeper")["resources"]["limits"]
    assert quantity(limits["memory"]) > cfg.host_tier.capacity_bytes, \
        "the daemon is charged for the arena pages it writes itself"


def test_images_follow_the_docker_conventions() -> None:
    services = yaml.safe_load((DEPLOY / "docker/compose.yaml").read_text())["services"]
    ds = daemonset()
    for c in ds["spec"]["template"]["spec"]["initContainers"] + ds["spec"]["template"]["spec"]["containers"]:
        assert c["image"] == services["kvkeeper"]["image"], c["name"]
    vllm = container(engine(), "vllm")
    assert vllm["image"] == services["vllm"]["image"]
    assert vllm["command"] == json.loads(dockerfile(VLLM_DOCKERFILE, r"^ENTRYPOINT (\[.*\])$")[-1])
    assert json.loads(dockerfile(DOCKERFILE, r"^ENTRYPOINT (\[.*\])$")[-1]) == ["kvkeeper"]


# --------------------------------------------------------------------------- the engine
def test_vllm_example_uses_the_node_daemon(tmp_path: Path) -> None:
    cfg, ds, dep = daemon_config(tmp_path), daemonset(), engine()
    vllm = container(dep, "vllm")
    args = vllm["args"]
    kv = json.loads(args[args.index("--kv-transfer-config") + 1])
    assert kv["kv_connector"] == "KVKeeperConnector"
    assert kv["kv_connector_module_path"] == "kvkeeper.connector"
    extra = kv["kv_connector_extra_config"]
    assert extra["kvkeeper_url"] == "unix://" + cfg.listen.socket
    config_mod = pytest.importorskip("kvkeeper.connector.config")
    parsed = config_mod.ConnectorConfig.from_extra(extra, kv_role=kv["kv_role"], env={})
    assert parsed.url == extra["kvkeeper_url"] and parsed.load and parsed.save
    # The daemon's two node directories, at the paths the daemon reports.
    main = container(ds, "kvkeeper")
    for path, writable in ((os.path.dirname(cfg.listen.socket), False), (cfg.host_tier.shm_dir, True)):
        mine, theirs = volume_at(dep, vllm, path), volume_at(ds, main, path)
        assert mine["hostPath"]["path"] == theirs["hostPath"]["path"] == path
        assert mine["hostPath"]["type"] == "Directory", "the daemon creates it; never make a stray one"
        assert mine["readOnly"] is not writable, path
    spec = dep["spec"]["template"]["spec"]
    assert int(cfg.listen.socket_group) in spec["securityContext"]["supplementalGroups"]
    assert spec["securityContext"]["runAsNonRoot"] is True and spec["securityContext"]["runAsUser"] != 0
    for key in ("hostIPC", "hostNetwork", "hostPID"):
        assert not spec.get(key), key
    # Scheduled only beside a daemon.
    [term] = spec["affinity"]["podAffinity"]["requiredDuringSchedulingIgnoredDuringExecution"]
    assert term["topologyKey"] == "kubernetes.io/hostname"
    assert term["namespaces"] == [one("Namespace", "kvkeeper")["metadata"]["name"]]
    assert selects(term["labelSelector"]["matchLabels"], ds["spec"]["template"]["metadata"]["labels"])
    labels = dep["spec"]["template"]["metadata"]["labels"]
    assert selects(dep["spec"]["selector"]["matchLabels"], labels)
    svc = one("Service", "vllm")
    assert selects(svc["spec"]["selector"], labels)
    ports = {p["name"]: p["containerPort"] for p in vllm["ports"]}
    [sp] = svc["spec"]["ports"]
    assert str(ports[sp["targetPort"]]) == args[args.index("--port") + 1]
    assert "--enable-prefix-caching" in args


# --------------------------------------------------------------------------- namespace, kustomize
def test_namespace_admits_the_hostpath_pods() -> None:
    ns = one("Namespace", "kvkeeper")
    # Pod Security "baseline" and "restricted" refuse hostPath volumes outright.
    assert ns["metadata"]["labels"]["pod-security.kubernetes.io/enforce"] == "privileged"
    kz = yaml.safe_load(KUSTOMIZATION.read_text())
    assert kz["namespace"] == ns["metadata"]["name"]
    for _, _, d in all_documents():
        assert "namespace" not in d["metadata"], "kustomize (or kubectl -n) sets it"


def test_kustomization_lists_the_daemon_manifests() -> None:
    kz = yaml.safe_load(KUSTOMIZATION.read_text())
    assert kz["apiVersion"] == "kustomize.config.k8s.io/v1beta1" and kz["kind"] == "Kustomization"
    expected = {p.name for p in K8S.glob("*.yaml")} - {KUSTOMIZATION.name, EXAMPLE.name}
    assert sorted(kz["resources"]) == sorted(expected)


@pytest.mark.skipif(shutil.which("kubectl") is None, reason="no kubectl")
def test_kustomize_build_if_kubectl_exists() -> None:
    r = subprocess.run(["kubectl", "kustomize", str(K8S)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    built = [d for d in yaml.safe_load_all(r.stdout) if d]
    assert len(built) == sum(len(manifests(K8S / f)) for f in yaml.safe_load(KUSTOMIZATION.read_text())["resources"])
    for doc in built:
        check_schema(doc, K8S_VERSIONS[-1])
        if doc["kind"] != "Namespace":
            assert doc["metadata"]["namespace"] == "kvkeeper", doc["metadata"]


# --------------------------------------------------------------------------- live checks
@pytest.fixture
def shortdir(sockdir: str) -> Path:
    """tests/conftest.py's short temporary directory (unix socket paths are short)."""
    return Path(sockdir)


def test_daemon_serves_with_the_configmap_config(shortdir: Path) -> None:
    """`kvkeeper serve` with the ConfigMap's file (node paths moved into a temp dir, a small
    arena); the DaemonSet's readiness command, run as written, says healthy, then unhealthy."""
    cm = one("ConfigMap", "kvkeeper-config")
    toml = shortdir / "kvkeeper.toml"
    toml.write_text(cm["data"]["kvkeeper.toml"])
    sock, arena_dir, port = shortdir / "run" / "kvkeeper.sock", shortdir / "shm", free_port()
    sock.parent.mkdir()
    arena_dir.mkdir()
    name = f"kvkeeper-k8stest-{uuid.uuid4().hex[:12]}"
    proc = subprocess.Popen(
        KVKEEPER + ["serve", "--config", str(toml), "--socket", str(sock), "--tcp", "",
                    "--metrics", f"127.0.0.1:{port}", "--capacity", "1MiB", "--page-size", "4KiB",
                    "--set", f"host_tier.shm_dir={arena_dir}", "--set", f"host_tier.name={name}",
                    "--set", f"listen.socket_group={os.getegid()}", "--set", "server.grace_seconds=1"],
        stderr=subprocess.PIPE, text=True, env=clean_env())
    cfg = load_config(str(toml), env={})
    [probe_path] = dockerfile(DOCKERFILE, r"^COPY deploy/docker/healthcheck\.py (\S+)$")
    cmd = [{"python": sys.executable, probe_path: str(DEPLOY / "docker/healthcheck.py"),
            "unix://" + cfg.listen.socket: f"unix://{sock}"}.get(a, a)
           for a in container(daemonset(), "kvkeeper")["readinessProbe"]["exec"]["command"]]
    try:
        wait_until(lambda: socket_accepts(sock), 30, "the daemon's socket", proc)
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=clean_env())
        assert r.returncode == 0 and "SERVING" in r.stdout, r.stdout + r.stderr
        # The socket and the arena: group rw, nothing for others (engines come in by the group).
        for path in (sock, arena_dir / name):
            assert stat.S_IMODE(os.stat(path).st_mode) == cfg.listen.socket_mode & 0o660, path
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as resp:
            assert "kvkeeper_" in resp.read().decode()
    finally:
        rc, err = stop(proc)
    assert rc == 0, err
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=30, env=clean_env())
    assert r.returncode == 1 and r.stdout.startswith("unhealthy: "), r.stdout


def _as(caps: list[str], cmd: list[str], uid: int = 0, groups: tuple[int, ...] = ()) -> int:
    """Run `cmd` as `uid` with only `caps` (and supplementary `groups`); its exit status."""
    mask = "-all" + "".join(f",+{c.lower()}" for c in caps)
    ids = [] if uid == 0 else [f"--reuid={uid}", f"--regid={uid}",
                              f"--groups={','.join(map(str, groups))}" if groups else "--clear-groups"]
    return subprocess.run(["setpriv", *ids, f"--inh-caps={mask}", f"--ambient-caps={mask}",
                           f"--bounding-set={mask}", "--", *cmd], capture_output=True).returncode


@pytest.mark.skipif(os.geteuid() != 0 or shutil.which("setpriv") is None,
                    reason="needs root and setpriv to drop capabilities and switch users")
def test_host_dirs_init_container_with_its_capabilities(shortdir: Path) -> None:
    """The init container's command, on directories as the kubelet makes them (root, 0755),
    works with its two capabilities and not with either alone; afterwards the daemon's user
    writes there, a member of its group only enters, anyone else neither."""
    ds, uid = daemonset(), image_uid()
    shortdir.chmod(0o755)  # the other users below must reach the directories in it
    init = container(ds, "host-dirs", init=True)
    caps = init["securityContext"]["capabilities"]["add"]
    node_dirs = init["command"][-2:]
    for cap in caps:
        dirs = {p: shortdir / f"alone-{cap}{i}" for i, p in enumerate(node_dirs)}
        for d in dirs.values():
            d.mkdir(mode=0o755)
        assert _as([c for c in caps if c != cap], [str(dirs.get(a, a)) for a in init["command"]]) != 0, \
            f"works without {cap}: drop it from the init container"
    dirs = {p: shortdir / f"node{i}" for i, p in enumerate(node_dirs)}
    for d in dirs.values():
        d.mkdir(mode=0o755)
    cmd = [str(dirs.get(a, a)) for a in init["command"]]
    assert _as(caps, cmd) == 0
    assert _as(caps, cmd) == 0, "a restarted pod finds the directories already given away"
    engine_uid = engine()["spec"]["template"]["spec"]["securityContext"]["runAsUser"]
    for d in dirs.values():
        st = os.stat(d)
        assert (st.st_uid, st.st_gid, stat.S_IMODE(st.st_mode)) == (uid, uid, 0o750)
        assert _as([], ["touch", str(d / "f")], uid=uid) == 0
        assert _as([], ["ls", str(d)], uid=engine_uid, groups=(uid,)) == 0
        assert _as([], ["touch", str(d / "g")], uid=engine_uid, groups=(uid,)) != 0, \
            "an engine must not replace the socket or the arena"
        assert _as([], ["ls", str(d)], uid=engine_uid) != 0
