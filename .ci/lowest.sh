#!/usr/bin/env bash
# CI job: the suite with the lowest allowed version of every direct dependency (the floors of
# pyproject.toml, pinned by .ci/floors.py), in its own venv. torch's floor has no CPU wheel
# here, so this job pulls its CUDA build from PyPI (measured ~1-2 min; see the report in issue 17).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${LOWEST_VENV:-.venv-lowest}
python3 -m venv --clear "$venv"
python3 .ci/floors.py trainer dev > "$venv/floors.txt"
"$venv/bin/python" -m pip install -q --disable-pip-version-check -c "$venv/floors.txt" -e ".[trainer,dev]" 2>&1 \
  | grep -v "^WARNING: Location" >&2 || true
# Refuse to test what was not asked for: every pin must have been honoured.
"$venv/bin/python" - "$venv/floors.txt" <<'PY'
import sys
from importlib.metadata import version
from packaging.requirements import Requirement
from packaging.version import Version
bad = []
for line in filter(None, map(str.strip, open(sys.argv[1]))):
    req = Requirement(line)
    if req.marker is not None and not req.marker.evaluate():
        continue
    want = next(iter(req.specifier)).version
    if Version(version(req.name)) != Version(want):
        bad.append(f"{req.name}: {version(req.name)} installed, floor {want}")
print("\n".join(bad) or "lowest: every direct dependency at its floor", file=sys.stderr)
sys.exit(1 if bad else 0)
PY
"$venv/bin/python" -m pytest -q
