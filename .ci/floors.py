"""Print a pip constraints file pinning every direct dependency to its floor (``>=X`` -> ``==X``).

``.ci/lowest.sh`` installs with it, the way ``--resolution lowest-direct`` does elsewhere: the
floors in pyproject.toml are then tested, not hoped for. Extras named on the command line
(``trainer``, ``dev``) are pinned too. A requirement without a floor is an error: every direct
dependency must say the lowest version it runs on.
"""

from __future__ import annotations

import re
import sys
from pathlib import Path

if sys.version_info >= (3, 11):
    import tomllib
else:
    import tomli as tomllib

# Tools of the test run itself, not of the package: their newest versions are fine.
UNPINNED = {"pytest", "pytest-timeout", "hypothesis", "matplotlib"}


def floors(extras: list[str]) -> list[str]:
    project = tomllib.loads((Path(__file__).resolve().parent.parent / "pyproject.toml").read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in extras:
        requirements += project["optional-dependencies"][extra]
    pins = []
    for requirement in requirements:
        spec, _, marker = requirement.partition(";")
        match = re.fullmatch(r"\s*([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*>=\s*([^,\s]+)\s*(,.*)?", spec)
        if match is None:
            raise SystemExit(f"floors: {requirement!r} has no '>=' floor")
        name, version = match.group(1), match.group(3)
        if name.lower() in UNPINNED:
            continue
        pins.append(f"{name}=={version}" + (f"; {marker.strip()}" if marker else ""))
    return pins


if __name__ == "__main__":
    print("\n".join(floors(sys.argv[1:])))
