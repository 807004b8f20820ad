"""deploy/systemd/kvkeeper.service under a real systemd (systemd_boot_check.sh):
opt-in, because it needs root, namespaces, overlayfs and a virtualenv outside
/home, /root and /tmp, which the test suite's own .venv usually is not.

    KVKEEPER_SYSTEMD_BOOT_VENV=/srv/kvk-venv bash tests/run.sh tests/deploy
"""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

SCRIPT = Path(__file__).with_name("systemd_boot_check.sh")
VENV = os.environ.get("KVKEEPER_SYSTEMD_BOOT_VENV", "")


@pytest.mark.skipif(not VENV, reason="set KVKEEPER_SYSTEMD_BOOT_VENV to a venv with kvkeeper "
                                     "outside /home, /root and /tmp to boot the unit under systemd")
def test_unit_under_a_real_systemd() -> None:
    if os.geteuid() != 0:
        pytest.skip("needs root")
    r = subprocess.run(["bash", str(SCRIPT), VENV], capture_output=True, text=True, timeout=300)
    if r.returncode == 77:
        pytest.skip(f"systemd cannot boot in a namespace here: {r.stdout[-500:]}{r.stderr[-500:]}")
    assert r.returncode == 0, r.stdout + r.stderr
    assert "systemd boot check: all passed" in r.stdout
