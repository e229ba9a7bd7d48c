#!/usr/bin/env bash
# CI job: the suite with the lowest allowed version of every direct dependency (the floors of
# pyproject.toml, pinned by .ci/floors.py), in its own venv. torch's floor has no CPU wheel
# here, so this job pulls its CUDA build from PyPI (measured ~1-2 min; see the report in issue 17).
set -euo pipefail
cd "$(dirname "$0")/.."
venv=${LOWEST_VENV:-.venv-lowest}
python3 -m venv --clear "$venv"
python3 .ci/floors.py trainer dev > "$venv/floors.txt"
pip_install() {  # pip's own exit status, its output without the registry mirror's noise
  local rc=0
  "$venv/bin/python" -m pip install -q --disable-pip-version-check "$@" >"$venv/pip.log" 2>&1 || rc=$?
  grep -v "^WARNING: Location" "$venv/pip.log" >&2 || true
  return "$rc"
}
# The floor of torch is a 2 GB CUDA wheel: a download or install cut short can leave its
# metadata in place with the package half there, and then every test needing torch fails
# on "No module named 'torch._utils'". So pip's status counts, torch must import, and a
# failed or broken install is done once more from a fresh download before the job fails.
imports_ok() { "$venv/bin/python" -c "import torch, numpy; torch.zeros(1)" >/dev/null 2>&1; }
if ! pip_install -c "$venv/floors.txt" -e ".[trainer,dev]" || ! imports_ok; then
  echo "lowest: the install failed or torch does not import; installing again from a fresh download" >&2
  pip_install --no-cache-dir --force-reinstall -c "$venv/floors.txt" -e ".[trainer,dev]"
  imports_ok || { "$venv/bin/python" -c "import torch"; exit 1; }
fi
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
