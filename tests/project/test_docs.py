"""The docs name only what exists: every ``stream_reward.*`` name resolves, every repo path
is in the tree, and every ``python -m`` module imports. The README's first screen carries
the two commands and a trainer example."""

from __future__ import annotations

import importlib
import importlib.util
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = sorted(
    p
    for p in [ROOT / "README.md", ROOT / "CHANGELOG.md", *ROOT.glob("docs/*.md"), *ROOT.glob("*/README.md")]
    if p.exists() and ".venv" not in p.parts
)
TOP = ("stream_reward/", "workers/", "tests/", "benchmarks/", "docs/", "scripts/", ".ci/", "examples/")
DOTTED = re.compile(r"(?<![\w./-])stream_reward(?:\.[A-Za-z_]\w*)+")
PATH = re.compile(r"(?<![\w./-])((?:" + "|".join(re.escape(t) for t in TOP) + r")[\w./*-]*)")
PY_M = re.compile(r"python3? -m ([\w.]+)")


def _resolves(dotted: str) -> bool:
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        module = ".".join(parts[:cut])
        try:
            if importlib.util.find_spec(module) is None:
                continue
        except ModuleNotFoundError:  # a parent is a module, not a package
            continue
        value: object = importlib.import_module(module)
        for attr in parts[cut:]:
            if not hasattr(value, attr):
                return False
            value = getattr(value, attr)
        return True
    return False


def _names(pattern: re.Pattern[str]) -> list[tuple[str, str]]:
    """What the docs name, but for the changelog (it records old names on purpose) and
    placeholders in capitals (``stream_reward/bench/NAME.py``)."""
    found = set()
    for doc in DOCS:
        if doc.name == "CHANGELOG.md":
            continue
        for match in pattern.findall(doc.read_text()):
            if not re.search(r"(?:^|[./])[A-Z]{3,}(?:[./]|$)", match):
                found.add((doc.relative_to(ROOT).as_posix(), match.rstrip(".")))
    return sorted(found)


def test_the_scan_sees_the_docs() -> None:
    assert len(DOCS) >= 8
    assert len(_names(DOTTED)) >= 20 and len(_names(PATH)) >= 20


@pytest.mark.parametrize(("doc", "name"), _names(DOTTED))
def test_every_stream_reward_name_the_docs_use_resolves(doc: str, name: str) -> None:
    assert _resolves(name), f"{doc} names {name}, which does not resolve"


@pytest.mark.parametrize(("doc", "path"), _names(PATH))
def test_every_repo_path_the_docs_use_exists(doc: str, path: str) -> None:
    found = list(ROOT.glob(path)) if "*" in path else [ROOT / path]
    assert found and all(p.exists() for p in found), f"{doc} names {path}, which is not in the tree"


@pytest.mark.parametrize(("doc", "module"), _names(PY_M))
def test_every_python_m_module_the_docs_run_exists(doc: str, module: str) -> None:
    if module.split(".")[0] not in ("stream_reward", "workers"):
        return  # another project's program (pytest, pip, verl's trainer)
    assert importlib.util.find_spec(module) is not None, f"{doc} runs python -m {module}, which does not exist"


def test_readme_opens_with_the_two_commands_and_a_trainer_example() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    first_python = next(i for i, line in enumerate(lines, 1) if line.strip() == "```python")
    assert first_python <= 45
    head = "\n".join(lines[:first_python])
    assert "scripts/setup.sh && .venv/bin/stream-reward demo" in head
    assert "scripts/setup.sh && .venv/bin/python -m pytest -q" in head


def test_docs_have_an_index_naming_every_page() -> None:
    index = (ROOT / "docs" / "README.md").read_text()
    for page in (ROOT / "docs").glob("*.md"):
        if page.name != "README.md":
            assert f"({page.name})" in index, f"docs/README.md does not link {page.name}"
