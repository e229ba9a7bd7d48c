#!/usr/bin/env bash
# CI job: the whole suite on Python 3.10, the oldest declared, in its own venv (.venv310).
# Nothing skips here: there is no CPU wheel of torch for 3.10 on this machine, so [trainer]
# pulls torch's CUDA build from PyPI (~5 GB; measured 73 s to install). The README's own
# commands never need this interpreter.
set -euo pipefail
cd "$(dirname "$0")/.."
PY310=${PY310:-$HOME/.pyenv/versions/3.10.13/bin/python}
[ -x "$PY310" ] || { echo "py310: no Python 3.10 at $PY310 (set PY310)" >&2; exit 1; }
venv=${PY310_VENV:-.venv310}
"$PY310" -m venv --clear "$venv"
install() { "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" -e ".[trainer,dev]" 2>&1 | grep -v "^WARNING: Location" >&2 || true; }
imports() { "$venv/bin/python" -c "import sys, torch, tomli, exceptiongroup, stream_reward; assert sys.version_info[:2] == (3, 10)"; }
install
# A download of the CUDA wheel cut short can leave torch half installed: once more, fresh.
imports 2>/dev/null || { echo "py310: the install is broken; installing again" >&2; install --no-cache-dir --force-reinstall; imports; }
"$venv/bin/python" -m pytest -q
