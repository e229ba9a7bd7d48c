"""Every folder of the library is a regular package: a wheel built by setuptools'
package discovery leaves out a folder without ``__init__.py``."""

from pathlib import Path

import stream_reward


def test_every_library_folder_is_a_package() -> None:
    root = Path(stream_reward.__file__).parent
    folders = [p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))]
    assert folders  # the stages exist
    assert [str(p.relative_to(root)) for p in folders if not (p / "__init__.py").exists()] == []


def test_the_wheel_installs_the_stream_reward_package_alone(tmp_path: Path) -> None:
    """Generic top-level names (``workers``, ``benchmarks``) stay in the repo: two projects
    shipping a ``workers`` package would overwrite each other in site-packages."""
    import shutil
    import subprocess
    import sys
    import zipfile

    root = Path(stream_reward.__file__).resolve().parents[1]
    source = tmp_path / "src"  # building in the checkout would leave build/ and *.egg-info behind
    for name in ("stream_reward", "workers", "benchmarks"):
        shutil.copytree(root / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(root / name, source / name)
    argv = [
        sys.executable,
        "-m",
        "pip",
        "wheel",
        "-q",
        "--no-deps",
        "-w",
        str(tmp_path),
        str(source),
    ]
    # With build isolation: the venvs CI tests in (lowest versions, Python 3.10) may carry an
    # older setuptools than pyproject's build-system asks for.
    built = subprocess.run(argv, capture_output=True, text=True, timeout=300)
    assert built.returncode == 0, built.stderr[-2000:]
    (wheel,) = tmp_path.glob("*.whl")
    tops = {name.split("/")[0] for name in zipfile.ZipFile(wheel).namelist()}
    assert {t for t in tops if not t.endswith(".dist-info")} == {"stream_reward"}
    assert "stream_reward/py.typed" in zipfile.ZipFile(wheel).namelist()
