"""Every folder of the library is a regular package: a wheel built by setuptools'
package discovery leaves out a folder without ``__init__.py``."""

from pathlib import Path

import stream_reward


def test_every_library_folder_is_a_package() -> None:
    root = Path(stream_reward.__file__).parent
    folders = [p for p in root.rglob("*") if p.is_dir() and p.name != "__pycache__" and any(p.glob("*.py"))]
    assert folders  # the stages exist
    assert [str(p.relative_to(root)) for p in folders if not (p / "__init__.py").exists()] == []
