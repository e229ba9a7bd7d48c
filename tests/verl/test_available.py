"""The placeholder that says why the verl suite did not run (it never imports verl)."""

from __future__ import annotations

import pytest
from verl_support import SKIP_REASON


def test_verl_suite_runs_here() -> None:
    if SKIP_REASON:
        pytest.skip(SKIP_REASON)


def test_import_without_verl() -> None:
    """``pkg://stream_reward.verl`` imports with verl (and Ray) unimportable."""
    import subprocess
    import sys

    code = (
        "import sys; sys.modules['verl'] = None; sys.modules['ray'] = None\n"
        "import stream_reward.verl as v\n"
        "assert hasattr(v.StreamRewardLoopManager, 'run_single')\n"
        "assert hasattr(v.StreamRewardLoopManager, 'assemble_rm_scores')\n"
    )
    subprocess.run([sys.executable, "-c", code], check=True, timeout=60)
