"""What several ops test files share: whether a process is alive.

Imported as ``ops_support`` (pytest puts this folder on the path, as tests/trainer does
with trainer_support.py); tests/helpers.py holds what the whole suite shares.
"""

from __future__ import annotations

import os
from pathlib import Path


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # a zombie is dead for our purpose
    try:
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
