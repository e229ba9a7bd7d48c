"""The version of stream-reward, written here only: pyproject.toml and ``--version`` read it."""

__version__ = "0.1.0"
