"""The committed stubs match proto/, and the distribution installs under kvkeeper.* only."""
from __future__ import annotations

import filecmp
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PROTOS = ["kvkeeper", "admin", "residency"]
GENERATED = [f"{name}{suffix}" for name in PROTOS for suffix in ("_pb2.py", "_pb2.pyi", "_pb2_grpc.py")]


def test_committed_stubs_match_proto(tmp_path: Path) -> None:
    pytest.importorskip("grpc_tools")
    shutil.copytree(ROOT / "proto", tmp_path / "proto")
    for name in GENERATED:
        (tmp_path / "proto/kvkeeper/v1" / name).unlink()
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I", "proto", "--python_out=proto",
                    "--pyi_out=proto", "--grpc_python_out=proto",
                    *(f"proto/kvkeeper/v1/{name}.proto" for name in PROTOS)],
                   check=True, cwd=tmp_path)
    drift = [n for n in GENERATED
             if not filecmp.cmp(ROOT / "proto/kvkeeper/v1" / n, tmp_path / "proto/kvkeeper/v1" / n,
                                shallow=False)]
    assert not drift, f"stubs out of date with proto/: {drift}; run `bash tools/gen_proto.sh`"


def test_gen_script_uses_the_same_command() -> None:
    script = (ROOT / "tools/gen_proto.sh").read_text()
    assert "-I proto --python_out=proto --pyi_out=proto --grpc_python_out=proto" in script
    for name in PROTOS:
        assert f"proto/kvkeeper/v1/{name}.proto" in script, name


def test_every_proto_is_covered_by_the_drift_check() -> None:
    protos = sorted(p.stem for p in (ROOT / "proto/kvkeeper/v1").glob("*.proto"))
    assert protos == sorted(PROTOS)


def test_wheel_installs_only_under_kvkeeper(tmp_path: Path) -> None:
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(tmp_path), str(ROOT)], check=True)
    wheel = next(tmp_path.glob("kvkeeper-*.whl"))
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    tops = {t for t in tops if not t.endswith(".dist-info")}
    assert tops == {"kvkeeper"}, tops
    names = zipfile.ZipFile(wheel).namelist()
    # Every source module ships: a subpackage missing from pyproject's
    # explicit package list would install a daemon that fails on import.
    folders = {"server": "kvkeeper/server", "client": "kvkeeper/client",
               "connector": "kvkeeper/connector", "proto/kvkeeper/v1": "kvkeeper/v1"}
    expected = [f"{dest}/{path.relative_to(ROOT / src).as_posix()}"
                for src, dest in folders.items() for path in (ROOT / src).rglob("*.py")]
    assert len(expected) > 50
    missing = sorted(set(expected) - set(names))
    assert not missing, f"modules missing from the wheel (add their packages to pyproject.toml): {missing}"
