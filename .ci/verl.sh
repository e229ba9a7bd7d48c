#!/usr/bin/env bash
# CI, verl environment: stream-reward inside verl 0.9.1's own reward loop.
# Its own venv (.venv-verl: verl brings Ray, transformers, Hydra; CPU torch), then
# tests/verl with STREAM_REWARD_REQUIRE_VERL=1, which turns "verl missing" from a
# skip into an error: here the suite must run. Then the verl_loop bench at a small
# size, to check that it runs (its numbers are not judged on a CI machine).
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VERL_VENV:-.venv-verl}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" >&2 || true; }
pip "torch==2.13.0" "verl==0.9.1"
pip -e ".[trainer,dev]"
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version
assert version("verl") == "0.9.1", version("verl")
import torch, verl.experimental.reward_loop  # noqa: F401  (a broken install fails here, loudly)
import math_verify  # noqa: F401  (the dev extra's: tests/verl compare --scorer math-verify with verl's own)
PY

export STREAM_REWARD_REQUIRE_VERL=1
"$VENV/bin/python" -m pytest -q -rs tests/verl
"$VENV/bin/stream-reward" bench verl_loop --json --n 128 --repeats 1 >/dev/null
