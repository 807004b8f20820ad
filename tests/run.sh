#!/usr/bin/env bash
# The whole test suite from nothing: system tools, a fresh virtualenv, every
# Python dependency, then pytest. Extra arguments go to pytest.
set -euo pipefail
cd "$(dirname "$0")/.."

# promtool (Debian's prometheus package) checks the metrics exposition.
if ! command -v promtool >/dev/null 2>&1; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    echo "tests/run.sh: installing Debian's prometheus for promtool" >&2
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null
    apt-get install -y -qq --no-install-recommends prometheus >/dev/null
  else
    echo "tests/run.sh: promtool not found and cannot apt-get it; the metrics lint test will skip" >&2
  fi
fi

VENV=${KVKEEPER_TEST_VENV:-.venv}
[ -x "$VENV/bin/python" ] || python3 -m venv "$VENV"
"$VENV/bin/python" -m pip install -q --upgrade pip >/dev/null
"$VENV/bin/python" -m pip install -q -e '.[test]'
exec "$VENV/bin/python" -m pytest "$@"
