"""The tests mirror the package: a reader who opens ``stream_reward/<stage>/<module>.py``
finds its tests in ``tests/<stage>/test_<module>.py``. The folders beside the stages hold
what no one component owns: whole-pipeline tests (``e2e``), repo-level checks
(``project``), verl's own reward loop (``verl``), the benches (``bench``) and the
scorers the worker processes load by path (``data``)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
TESTS = ROOT / "tests"
NOT_STAGES = {"e2e", "project", "verl", "bench", "data"}


def _test_files() -> list[Path]:
    return sorted(p for p in TESTS.rglob("test_*.py") if "__pycache__" not in p.parts)


def test_no_test_file_sits_at_the_top_of_tests() -> None:
    assert [p.name for p in TESTS.glob("test_*.py")] == []


def test_every_test_folder_is_a_stage_of_the_package_or_a_named_exception() -> None:
    stages = {p.name for p in (ROOT / "stream_reward").iterdir() if (p / "__init__.py").exists()}
    folders = {p.relative_to(TESTS).parts[0] for p in _test_files()}
    assert folders - stages - NOT_STAGES == set()


def test_test_files_are_named_after_components_not_findings() -> None:
    assert [str(p.relative_to(TESTS)) for p in _test_files() if "attack" in p.name or "_from_" in p.name] == []


def test_test_file_names_are_unique_across_folders() -> None:
    # No __init__.py under tests/: pytest imports each file by its basename, and refuses a second one.
    names = [p.name for p in _test_files()]
    assert sorted({n for n in names if names.count(n) > 1}) == []
