#!/usr/bin/env bash
# Regenerates the Python stubs of proto/kvkeeper/v1 in place.
# Usage: bash tools/gen_proto.sh   (needs grpcio-tools, installed by the test extra)
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
"$PY" -m grpc_tools.protoc -I proto --python_out=proto --pyi_out=proto --grpc_python_out=proto proto/kvkeeper/v1/kvkeeper.proto proto/kvkeeper/v1/admin.proto proto/kvkeeper/v1/residency.proto
