#!/usr/bin/env bash
# Runs deploy/systemd/kvkeeper.service, sandboxing and all, under a real systemd:
# systemd is PID 1 of private PID, mount, UTS and network namespaces, with /run
# a fresh tmpfs and /etc, /var overlaid (nothing on the host changes; /dev/shm
# is the host's, as for a real service). Then it checks what the unit promises:
#
#   Type=notify start (active only after READY=1), the socket and its modes,
#   the arena in the host's /dev/shm, a group member reaching the socket,
#   Restart=on-failure after SIGKILL, a clean stop (STOPPING=1, exit 0, arena and
#   /run/kvkeeper removed), a disk tier under StateDirectory=, and a config
#   error (exit 2) that is not restarted.
#
# Usage (as root):  bash tests/deploy/systemd_boot_check.sh VENV
#   VENV: a virtualenv with kvkeeper installed whose python lies outside /home,
#   /root, /tmp and /var/tmp (ProtectHome= and PrivateTmp= hide those from the
#   service), e.g.:  /usr/bin/python3 -m venv /srv/kvk-venv && /srv/kvk-venv/bin/pip install .
# tests/deploy/test_deploy_systemd_boot.py runs it when KVKEEPER_SYSTEMD_BOOT_VENV names one.
set -euo pipefail

VENV=${1:?usage: systemd_boot_check.sh VENV}
VENV=$(cd "$VENV" && pwd)
ROOT=$(cd "$(dirname "$0")/../.." && pwd)
[ "$(id -u)" = 0 ] || { echo "needs root" >&2; exit 77; }
[ -x /lib/systemd/systemd ] || { echo "no /lib/systemd/systemd" >&2; exit 77; }
"$VENV/bin/kvkeeper" version >/dev/null

W=$(mktemp -d /tmp/kvk-sdboot.XXXXXX)
NAME="kvkeeper-sdboot-$$"
NSPID=""
cleanup() {
  if [ -n "$NSPID" ]; then kill -9 "$NSPID" 2>/dev/null || true; fi
  sleep 0.5
  rm -f "/dev/shm/$NAME"
  rm -rf "$W"
}
trap cleanup EXIT

cat > "$W/inner.sh" <<EOF
#!/bin/bash
set -e
mount --make-rprivate /
mount -t tmpfs -o mode=755 tmpfs /run
for d in etc var; do
  mkdir -p $W/\$d-up $W/\$d-work
  mount -t overlay overlay -o lowerdir=/\$d,upperdir=$W/\$d-up,workdir=$W/\$d-work /\$d
done
systemd-sysusers $ROOT/deploy/systemd/kvkeeper.sysusers >/dev/null 2>&1 || {
  echo 'kvkeeper:x:990:990:kvkeeper:/var/lib/kvkeeper:/usr/sbin/nologin' >> /etc/passwd
  echo 'kvkeeper:x:990:' >> /etc/group; }
echo 'vllm:x:991:991::/nonexistent:/usr/sbin/nologin' >> /etc/passwd
echo 'vllm:x:991:' >> /etc/group
sed -i 's/^\(kvkeeper:x:[0-9]*:\)\$/\1vllm/' /etc/group
install -D -m 0644 $ROOT/deploy/systemd/kvkeeper.toml /etc/kvkeeper/kvkeeper.toml
sed -i 's/^capacity_bytes = "8GiB"/capacity_bytes = "64MiB"/' /etc/kvkeeper/kvkeeper.toml
mkdir -p /run/systemd/system/kvkeeper.service.d
cp $ROOT/deploy/systemd/kvkeeper.service /run/systemd/system/
# Only what the test needs differs from the shipped unit: where kvkeeper is,
# where its output goes (no journald here), a unique arena name, and no
# sysinit.target (a booted host has it; here it would start the host's services).
cat > /run/systemd/system/kvkeeper.service.d/zz-test.conf <<EOT
[Unit]
DefaultDependencies=no
[Service]
ExecStart=
ExecStart=$VENV/bin/kvkeeper serve --config /etc/kvkeeper/kvkeeper.toml
Environment=KVKEEPER_HOST_TIER_NAME=$NAME
StandardOutput=append:/run/kvk-daemon.log
StandardError=append:/run/kvk-daemon.log
EOT
cat > /run/systemd/system/kvktest.target <<EOT
[Unit]
Description=kvkeeper boot check
DefaultDependencies=no
Wants=kvkeeper.service
EOT
exec env container=kvkeeper-check /lib/systemd/systemd --system --unit=kvktest.target --show-status=no
EOF
chmod +x "$W/inner.sh"

setsid unshare --pid --fork --mount --uts --net --mount-proc "$W/inner.sh" >"$W/systemd.log" 2>&1 &
UNSHARE=$!
for _ in $(seq 100); do
  NSPID=$(pgrep -P "$UNSHARE" || true)
  [ -n "$NSPID" ] && break
  sleep 0.1
done
[ -n "$NSPID" ] || { echo "namespace did not start"; cat "$W/systemd.log"; exit 77; }

ns() { nsenter -t "$NSPID" -a "$@"; }
prop() { ns systemctl show kvkeeper -p "$1" --value; }
is_prop() { [ "$(prop "$1")" = "$2" ]; }   # evaluated anew on each try of wait_for
fail() { echo "FAIL: $*"; ns systemctl --no-pager status kvkeeper || true; ns cat /run/kvk-daemon.log || true; exit 1; }
wait_for() {  # seconds, command...
  local n=$(( $1 * 10 )); shift
  for _ in $(seq "$n"); do "$@" >/dev/null 2>&1 && return 0; sleep 0.1; done
  return 1
}

wait_for 30 ns systemctl status --no-pager kvktest.target \
  || { echo "systemd did not come up here"; cat "$W/systemd.log"; exit 77; }

echo "-- start (Type=notify)"
wait_for 60 is_prop ActiveState active || fail "kvkeeper.service is not active"
case "$(prop StatusText)" in serving*) ;; *) fail "STATUS=serving not received" ;; esac
[ "$(prop NRestarts)" = 0 ] || fail "restarted while starting"

echo "-- socket, runtime directory, arena"
[ "$(ns stat -c '%A %U %G' /run/kvkeeper)" = "drwxr-x--- kvkeeper kvkeeper" ] || fail "/run/kvkeeper modes"
[ "$(ns stat -c '%A %U %G' /run/kvkeeper/kvkeeper.sock)" = "srw-rw---- kvkeeper kvkeeper" ] || fail "socket modes"
[ "$(stat -c %s "/dev/shm/$NAME")" = 67108864 ] || fail "arena not in the host's /dev/shm"
ns setpriv --reuid=vllm --regid=vllm --init-groups \
  "$VENV/bin/kvkeeper" status --url unix:///run/kvkeeper/kvkeeper.sock | grep -q "health *SERVING" \
  || fail "a member of group kvkeeper cannot reach the socket"
[ "$(prop LimitMEMLOCK)" = infinity ] && [ "$(prop LimitNOFILE)" = 1048576 ] || fail "limits"

echo "-- Restart=on-failure after SIGKILL"
MAIN=$(prop MainPID)
ns kill -9 "$MAIN"
wait_for 30 is_prop NRestarts 1 || fail "not restarted after SIGKILL"
wait_for 30 is_prop ActiveState active || fail "not active after the restart"
[ "$(prop MainPID)" != "$MAIN" ] || fail "same main PID after the restart"

echo "-- stop (STOPPING=1, drain, clean up)"
ns systemctl stop kvkeeper
[ "$(prop Result)" = success ] && [ "$(prop ExecMainStatus)" = 0 ] || fail "unclean stop"
ns grep -q "signal received: draining" /run/kvk-daemon.log || fail "no drain on stop"
[ ! -e "/dev/shm/$NAME" ] || fail "arena left behind after stop"
ns test ! -e /run/kvkeeper || fail "/run/kvkeeper left behind"

echo "-- disk tier under StateDirectory="
ns sh -c 'printf "\n[disk_tier]\npath = \"/var/lib/kvkeeper/disk\"\ncapacity_bytes = \"64MiB\"\n" >> /etc/kvkeeper/kvkeeper.toml'
ns systemctl start kvkeeper || fail "start with a disk tier"
[ "$(ns stat -c '%U' /var/lib/kvkeeper/disk)" = kvkeeper ] || fail "disk tier directory"
ns systemctl stop kvkeeper
[ "$(prop Result)" = success ] || fail "stop with a disk tier"

echo "-- a config error is not restarted"
ns sh -c 'echo "bogus_key = 1" >> /etc/kvkeeper/kvkeeper.toml'
ns systemctl start kvkeeper 2>/dev/null && fail "started with a bad config"
sleep 3
[ "$(prop ExecMainStatus)" = 2 ] || fail "config error did not exit 2"
[ "$(prop NRestarts)" = 0 ] || fail "a config error was restarted"

echo "systemd boot check: all passed"
