"""deploy/systemd: the unit passes `systemd-analyze verify` (and its offline
security review), the sysusers snippet creates the user, and the unit, its
drop-in and the example config agree with each other and with the daemon."""
from __future__ import annotations

import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from deploy_support import DEPLOY, parse_unit, seconds, unit_values
from kvkeeper.server.config import load_config

SYSTEMD = DEPLOY / "systemd"
UNIT = SYSTEMD / "kvkeeper.service"
DROPIN = SYSTEMD / "kvkeeper.service.d" / "venv.conf"
EXAMPLE = SYSTEMD / "kvkeeper.toml"
CONFIG_PATH = "/etc/kvkeeper/kvkeeper.toml"

needs_analyze = pytest.mark.skipif(shutil.which("systemd-analyze") is None,
                                   reason="systemd-analyze not installed (Debian package systemd)")


def unit() -> dict:
    return parse_unit(UNIT.read_text())


def svc(key: str) -> list[str]:
    return unit_values(unit(), "Service", key)


def runnable_copy(tmp_path: Path, with_dropin: bool = False) -> Path:
    """The unit (and drop-in) with ExecStart pointing at this interpreter's kvkeeper:
    `verify` checks that the binary exists, and /usr/bin/kvkeeper does not here."""
    here = f"{sys.executable} -m kvkeeper.server.cli"
    text = UNIT.read_text()
    assert "\nExecStart=/usr/bin/kvkeeper serve " in text
    dst = tmp_path / "kvkeeper.service"
    dst.write_text(text.replace("\nExecStart=/usr/bin/kvkeeper ", f"\nExecStart={here} "))
    if with_dropin:
        d = tmp_path / "kvkeeper.service.d"
        d.mkdir()
        drop = DROPIN.read_text()
        assert "\nExecStart=/opt/kvkeeper/venv/bin/kvkeeper serve " in drop
        (d / "venv.conf").write_text(drop.replace("\nExecStart=/opt/kvkeeper/venv/bin/kvkeeper ",
                                                  f"\nExecStart={here} "))
    return dst


def verify(path: Path) -> subprocess.CompletedProcess:
    return subprocess.run(["systemd-analyze", "verify", "--man=no", str(path)],
                          capture_output=True, text=True, timeout=60)


# --------------------------------------------------------------------------- systemd's own checks
@needs_analyze
def test_unit_passes_systemd_analyze_verify(tmp_path: Path) -> None:
    r = verify(runnable_copy(tmp_path))
    assert r.returncode == 0, r.stdout + r.stderr
    # verify prints warnings (unknown keys, bad values) but may still exit 0 for some.
    assert "kvkeeper.service" not in r.stdout + r.stderr, r.stdout + r.stderr


@needs_analyze
def test_unit_with_the_venv_dropin_passes_verify(tmp_path: Path) -> None:
    r = verify(runnable_copy(tmp_path, with_dropin=True))
    assert r.returncode == 0, r.stdout + r.stderr
    assert "kvkeeper.service" not in r.stdout + r.stderr, r.stdout + r.stderr


@needs_analyze
def test_verify_reports_the_missing_binary_honestly() -> None:
    """Unmodified, the unit names /usr/bin/kvkeeper (a distribution package's path);
    where that does not exist, verify says exactly that and nothing else."""
    if Path("/usr/bin/kvkeeper").exists():
        pytest.skip("/usr/bin/kvkeeper exists here")
    r = verify(UNIT)
    out = r.stdout + r.stderr
    problems = [line for line in out.splitlines() if "kvkeeper.service" in line]
    assert problems, out
    # The drop-in beside the unit is applied too: its venv path is missing here as well.
    for line in problems:
        assert "is not executable" in line and ("/usr/bin/kvkeeper" in line
                                                or "/opt/kvkeeper/venv/bin/kvkeeper" in line), out


@needs_analyze
def test_security_exposure_is_low(tmp_path: Path) -> None:
    r = subprocess.run(["systemd-analyze", "security", "--offline=yes", "--no-pager",
                        str(runnable_copy(tmp_path))], capture_output=True, text=True, timeout=60)
    if r.returncode != 0 and "offline" in r.stderr.lower():
        pytest.skip(f"systemd-analyze security --offline unsupported: {r.stderr.strip()}")
    m = re.search(r"Overall exposure level for kvkeeper\.service:\s*([\d.]+)", r.stdout)
    assert m, r.stdout + r.stderr
    # 0 = fully locked down, 10 = unprotected; systemd calls < 2 "OK".
    assert float(m.group(1)) < 2.0, r.stdout


@pytest.mark.skipif(shutil.which("systemd-sysusers") is None, reason="systemd-sysusers missing")
def test_sysusers_creates_the_user_and_group(tmp_path: Path) -> None:
    (tmp_path / "etc").mkdir()
    d = tmp_path / "usr/lib/sysusers.d"
    d.mkdir(parents=True)
    shutil.copy(SYSTEMD / "kvkeeper.sysusers", d / "kvkeeper.conf")
    r = subprocess.run(["systemd-sysusers", f"--root={tmp_path}"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr
    passwd = (tmp_path / "etc/passwd").read_text().splitlines()
    group = (tmp_path / "etc/group").read_text().splitlines()
    [user] = [p.split(":") for p in passwd if p.startswith("kvkeeper:")]
    [grp] = [g.split(":") for g in group if g.startswith("kvkeeper:")]
    assert user[3] == grp[2], (user, grp)               # primary group kvkeeper
    assert int(user[2]) < 1000                          # a system user
    assert user[5] == "/var/lib/kvkeeper" and user[6] == "/usr/sbin/nologin"
    assert svc("User") == ["kvkeeper"] and svc("Group") == ["kvkeeper"]


# --------------------------------------------------------------------------- the unit's choices
def test_notify_readiness_and_restart_policy() -> None:
    assert svc("Type") == ["notify"]
    assert svc("NotifyAccess") == ["main"]
    assert svc("Restart") == ["on-failure"]
    # Exit status 2 is a configuration error (kvkeeper.server.cli): no restart loop.
    assert svc("RestartPreventExitStatus") == ["2"]
    assert svc("ExecStart") == [f"/usr/bin/kvkeeper serve --config {CONFIG_PATH}"]
    assert svc("DynamicUser") in ([], ["no"])


def test_dropin_only_replaces_execstart() -> None:
    drop = parse_unit(DROPIN.read_text())
    assert set(drop) == {"Service"}
    assert [k for k, _ in drop["Service"]] == ["ExecStart", "ExecStart"]
    assert unit_values(drop, "Service", "ExecStart") == [
        f"/opt/kvkeeper/venv/bin/kvkeeper serve --config {CONFIG_PATH}"]


def test_directories_match_the_example_config() -> None:
    cfg = load_config(str(EXAMPLE), env={})
    assert svc("RuntimeDirectory") == ["kvkeeper"]
    assert cfg.listen.socket == "/run/kvkeeper/kvkeeper.sock"
    assert svc("StateDirectory") == ["kvkeeper"]
    assert svc("ConfigurationDirectory") == ["kvkeeper"]
    assert Path(CONFIG_PATH).parent.name == "kvkeeper"
    # The arena must stay in the host's /dev/shm, writable and shared with vLLM.
    assert cfg.host_tier.shm_dir == "/dev/shm"
    assert "/dev/shm" in " ".join(svc("ReadWritePaths")).split()
    assert svc("PrivateIPC") in ([], ["no"])
    assert not any("/dev/shm" in v for v in svc("TemporaryFileSystem") + svc("InaccessiblePaths"))
    # Group members reach the socket; nobody else does.
    assert cfg.listen.socket_mode == 0o660
    assert svc("RuntimeDirectoryMode") == ["0750"]
    # The example's disk tier (commented out) points into StateDirectory.
    assert 'path = "/var/lib/kvkeeper/disk"' in EXAMPLE.read_text()


def test_stop_timeout_exceeds_the_grace_period() -> None:
    cfg = load_config(str(EXAMPLE), env={})
    [stop] = svc("TimeoutStopSec")
    assert seconds(stop) >= cfg.server.grace_seconds + 10, (stop, cfg.server.grace_seconds)
    # ... and the default grace period too, for a config that does not set it.
    assert seconds(stop) > load_config(None, env={}).server.grace_seconds + 10


def test_hardening_settings() -> None:
    expected = {
        "ProtectSystem": "strict", "ProtectHome": "yes", "PrivateTmp": "yes",
        "NoNewPrivileges": "yes", "RestrictAddressFamilies": "AF_UNIX AF_INET AF_INET6",
        "LimitMEMLOCK": "infinity", "LimitNOFILE": "1048576", "PrivateDevices": "yes",
        "ProtectKernelTunables": "yes", "ProtectControlGroups": "yes", "LockPersonality": "yes",
        "RestrictSUIDSGID": "yes", "SystemCallArchitectures": "native",
    }
    for key, value in expected.items():
        assert svc(key) == [value], key
    assert svc("CapabilityBoundingSet") == []            # the empty assignment: no capabilities
    assert "@system-service" in svc("SystemCallFilter")


def test_unit_and_readme_name_the_same_install_paths() -> None:
    readme = (DEPLOY.parent / "README.md").read_text()
    deploy = readme[readme.index("## Deploy"):]
    for needle in ("deploy/systemd/kvkeeper.service", "kvkeeper.sysusers", "venv.conf",
                   CONFIG_PATH, "systemctl enable --now kvkeeper"):
        assert needle in deploy, needle


def test_the_arena_mode_the_docs_give_is_the_daemons() -> None:
    # app.py: the arena gets listen.socket_mode & 0o660 and the socket's group
    # (tests/server/test_app.py checks the file); nothing says 0600 any more.
    readme = (DEPLOY.parent / "README.md").read_text()
    unit = UNIT.read_text()
    for text in (readme, unit):
        assert "socket_mode & 0660" in text
        assert "created mode 0600" not in text and "created\n  mode 0600" not in text
    assert "sparse arena" not in unit           # prefault is the default
