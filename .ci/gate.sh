#!/usr/bin/env bash
# CI job: ruff (format and lint) and mypy over the tree, in the default venv (scripts/setup.sh first).
set -euo pipefail
cd "$(dirname "$0")/.."
.venv/bin/python -m pip install -q --disable-pip-version-check -e ".[lint]" 2>&1 | grep -v "^WARNING: Location" >&2 || true
.venv/bin/ruff format --check .
.venv/bin/ruff check .
.venv/bin/mypy
