#!/usr/bin/env bash
# CI, TRL environment: stream-reward's reward function inside TRL 1.16's own GRPOTrainer.
# Its own venv (.venv-trl: TRL brings transformers, datasets, accelerate; CPU torch),
# then tests/trl with STREAM_REWARD_REQUIRE_TRL=1, which turns "trl missing" from a
# skip into an error: here the GRPOTrainer test must run.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${TRL_VENV:-.venv-trl}
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
pip() { "$VENV/bin/python" -m pip install -q --disable-pip-version-check "$@" 2>&1 | grep -v "^WARNING: Location" >&2 || true; }
pip "torch==2.13.0" "trl==1.16.0"
pip -e ".[trainer,dev]"
"$VENV/bin/python" - <<'PY'
from importlib.metadata import version
assert version("trl") == "1.16.0", version("trl")
import torch, trl.trainer.grpo_trainer  # noqa: F401  (a broken install fails here, loudly)
PY

export STREAM_REWARD_REQUIRE_TRL=1
"$VENV/bin/python" -m pytest -q -rs tests/trl
