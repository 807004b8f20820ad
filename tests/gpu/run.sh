#!/usr/bin/env bash
# The GPU checks in one go: tests/gpu (the CUDA copy paths) and `kvkeeper bench gpu`.
#
#   bash tests/gpu/run.sh [WHEEL_DIR]
#
# On a CUDA machine, from the repository root; no vLLM, no daemon, no network.
# Needs a Python ($PYTHON, default python3) with torch built for CUDA, numpy,
# xxhash, protobuf, grpcio, grpcio-health-checking and pytest. What is missing
# is installed from WHEEL_DIR (or $KVKEEPER_WHEELS) with pip --no-index when
# given; otherwise the script names it and stops. kvkeeper itself is not
# installed: it is imported from this checkout through a temporary shim.
# Writes the bench's JSON to $OUT/bench_gpu.json (OUT defaults to .) and the
# pytest log to $OUT/tests_gpu.log. Takes 1-3 minutes; each step is bounded.
set -u
cd "$(dirname "$0")/../.."
PY=${PYTHON:-python3}
WHEELS=${1:-${KVKEEPER_WHEELS:-}}
OUT=${OUT:-.}
mkdir -p "$OUT"

# module -> pip name
declare -A NEED=([torch]=torch [numpy]=numpy [xxhash]=xxhash [google.protobuf]=protobuf
                 [grpc]=grpcio [grpc_health.v1]=grpcio-health-checking [pytest]=pytest)
missing=()
for mod in "${!NEED[@]}"; do
  "$PY" -c "import $mod" 2>/dev/null || missing+=("${NEED[$mod]}")
done
if ((${#missing[@]})); then
  if [[ -n "$WHEELS" ]]; then
    echo "[gpu] installing ${missing[*]} from $WHEELS"
    "$PY" -m pip install --no-index --find-links "$WHEELS" "${missing[@]}" || exit 2
  else
    echo "[gpu] $PY lacks: ${missing[*]}"
    echo "[gpu] install them, or pass a directory of wheels: bash tests/gpu/run.sh WHEEL_DIR"
    exit 2
  fi
fi
if ! "$PY" -c "import sys, torch; sys.exit(0 if torch.cuda.is_available() else 1)"; then
  "$PY" -c "import torch; print('[gpu] no CUDA: torch', torch.__version__, 'built for CUDA', torch.version.cuda)"
  exit 1
fi
"$PY" -c "import torch; print('[gpu]', torch.cuda.get_device_name(0), 'torch', torch.__version__, 'CUDA', torch.version.cuda)"

# kvkeeper.* from this checkout (the package layout pyproject.toml installs)
SHIM=$(mktemp -d)
trap 'rm -rf "$SHIM"' EXIT
mkdir "$SHIM/kvkeeper"
for d in server client connector; do ln -s "$PWD/$d" "$SHIM/kvkeeper/$d"; done
ln -s "$PWD/proto/kvkeeper/v1" "$SHIM/kvkeeper/v1"
export PYTHONPATH="$SHIM${PYTHONPATH:+:$PYTHONPATH}"

# Importable is not enough: the generated protobuf and gRPC code checks the
# runtime's versions at import (protobuf, grpcio as pyproject.toml pins them).
# Fail here, with the reason, rather than as an error in every test module.
if ! "$PY" -c "import kvkeeper.client, kvkeeper.connector.gpu.h2d, kvkeeper.server.bench" 2>"$SHIM/import.err"; then
  echo "[gpu] kvkeeper does not import with this Python's packages:"
  tail -5 "$SHIM/import.err"
  echo "[gpu] install the versions pyproject.toml names (protobuf, grpcio) and run again"
  exit 2
fi

rc=0
# --noconftest: tests/conftest.py starts daemons (and needs their dependencies); these do not.
echo "[gpu] pytest tests/gpu"
timeout 300 "$PY" -m pytest -q -rs --noconftest -p no:cacheprovider -o addopts= tests/gpu \
  2>&1 | tee "$OUT/tests_gpu.log"
((PIPESTATUS[0])) && rc=1
echo "[gpu] kvkeeper bench gpu"
timeout 240 "$PY" -c 'import sys; from kvkeeper.server.bench import main; sys.exit(main(sys.argv[1:]))' \
  gpu --out "$OUT/bench_gpu.json" || rc=1
echo "[gpu] done (rc=$rc); results: $OUT/tests_gpu.log, $OUT/bench_gpu.json"
exit $rc
