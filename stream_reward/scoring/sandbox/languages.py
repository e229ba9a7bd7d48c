"""The languages the sandbox runs: their fence tags, how a response's code block is
chosen, and where each language's toolchain lives on the host.

The block rule (``choose_program``), as graders apply it:

* fences are ```` ``` ```` or ``~~~`` (three or more; a block closes with the same run);
  empty blocks do not count;
* the task names a language (``language`` in the ground truth or extra_info): the
  last block tagged with that language, else the last block of any kind, run as
  that language (a Python block for a C++ task then fails to compile: a 0);
* the task names none: the last Python block, else the last block of any kind,
  in the language its tag names (untagged or unknown: Python).
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
import os
import re
import shutil
import subprocess
from typing import Any

from stream_reward.errors import VerifierError

__all__ = [
    "LANGUAGES",
    "Toolchain",
    "canonical",
    "choose_program",
    "fenced_blocks",
    "task_language",
    "find_toolchain",
    "default_toolchain_path",
]

# fence tag (lower case) -> language
_TAGS = {
    "python": "python",
    "py": "python",
    "python3": "python",
    "cpp": "cpp",
    "c++": "cpp",
    "cc": "cpp",
    "cxx": "cpp",
    "c": "c",
    "java": "java",
    "javascript": "javascript",
    "js": "javascript",
    "node": "javascript",
    "nodejs": "javascript",
    "go": "go",
    "golang": "go",
    "rust": "rust",
    "rs": "rust",
}
LANGUAGES = ("python", "cpp", "c", "java", "javascript", "go", "rust")

# The host programs each language needs (looked up on the toolchain PATH).
TOOLS = {
    "cpp": ("g++",),
    "c": ("gcc",),
    "java": ("javac", "java"),
    "javascript": ("node",),
    "go": ("go",),
    "rust": ("rustc", "cc"),  # cc: rustc's linker
}


def canonical(name: Any) -> str | None:
    """The language a fence tag or a task's ``language`` names, or None."""
    if not isinstance(name, str):
        return None
    return _TAGS.get(name.strip().lower())


_FENCE = re.compile(r"(?P<f>`{3,}|~{3,})[ \t]*(?P<tag>[\w+#.-]*)[^\n]*\n(?P<body>.*?)(?P=f)", re.S)


def fenced_blocks(response: str) -> list[tuple[str, str]]:
    """``(tag, body)`` of the response's non-empty fenced blocks, in order."""
    blocks = [(m.group("tag").lower(), m.group("body")) for m in _FENCE.finditer(response or "")]
    return [(tag, body) for tag, body in blocks if body.strip()]


def choose_program(response: str, language: str | None) -> tuple[str, str] | None:
    """``(language, code)`` of the block to run (see the module's rule), or None."""
    blocks = fenced_blocks(response)
    if not blocks:
        return None
    wanted = language or "python"
    for tag, body in reversed(blocks):
        if _TAGS.get(tag) == wanted:
            return wanted, body
    tag, body = blocks[-1]
    return (language or _TAGS.get(tag) or "python"), body


def task_language(ground_truth: Any, extra_info: dict[str, Any] | None) -> str | None:
    """The language the task names (``language`` in its ground truth, else in its
    extra_info), or None. An unknown name is None: the response's tags decide."""
    gt = ground_truth
    if isinstance(gt, (bytes, bytearray)):
        gt = gt.decode("utf-8", "replace")
    if isinstance(gt, str) and '"language"' in gt:
        try:
            gt = json.loads(gt)
        except ValueError:
            gt = None
    if isinstance(gt, dict) and "language" in gt:
        return canonical(gt["language"])
    return canonical((extra_info or {}).get("language"))


# ---------------------------------------------------------------- toolchains


@dataclasses.dataclass(frozen=True)
class Toolchain:
    """A language's host programs (absolute paths) and the host directories the
    sandbox must see for them."""

    language: str
    tools: dict[str, str]
    binds: tuple[str, ...]

    @property
    def version(self) -> str:
        """A digest of the first tool's version banner, for the compile cache's key."""
        first = next(iter(self.tools.values()))
        return _version((first, {"java": "-version", "go": "version"}.get(self.language, "--version")))


def default_toolchain_path() -> str:
    """The worker's PATH plus rustup's per-user directory (rustup installs there)."""
    cargo = os.path.join(os.path.expanduser("~"), ".cargo", "bin")
    return os.pathsep.join(p for p in (os.environ.get("PATH", ""), cargo) if p)


# Directories the sandbox already shows (isolation._ro_binds): no bind needed below them.
_SHOWN = ("/usr/", "/bin/", "/lib/", "/lib64/", "/sbin/")


def _bind_for(path: str) -> str | None:
    return None if any(path.startswith(p) for p in _SHOWN) else os.path.dirname(os.path.dirname(path))


@functools.cache
def _rust_sysroot(rustc: str, real: str) -> str:
    if os.path.basename(real) != "rustup":
        return os.path.dirname(os.path.dirname(real))
    # rustup's rustc is a proxy (by its name) that needs $RUSTUP_HOME; the sandbox runs the real one.
    out = subprocess.run([rustc, "--print", "sysroot"], capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


@functools.cache
def _version(argv: tuple[str, ...]) -> str:
    try:
        out = subprocess.run(argv, capture_output=True, text=True, timeout=60, check=False)
    except (OSError, subprocess.SubprocessError) as exc:
        raise VerifierError(f"{argv[0]} unusable: {exc}", reason="toolchain_missing") from exc
    return hashlib.sha256((out.stdout + out.stderr).encode()).hexdigest()[:16]


def find_toolchain(language: str, search_path: str) -> Toolchain:
    """The toolchain of ``language`` on ``search_path``; a missing program is the
    host's fault: VerifierError(reason="toolchain_missing") naming it."""
    tools: dict[str, str] = {}
    raw: dict[str, str] = {}
    for tool in TOOLS[language]:
        found = shutil.which(tool, path=search_path)
        if found is None:
            raise VerifierError(
                f"{language} toolchain missing on this host: {tool!r} not found (scripts/setup.sh installs it)",
                reason="toolchain_missing",
            )
        raw[tool] = found
        tools[tool] = os.path.realpath(found)
    binds = {b for b in map(_bind_for, tools.values()) if b}
    if language == "rust":
        try:
            sysroot = _rust_sysroot(raw["rustc"], tools["rustc"])
        except (OSError, subprocess.SubprocessError) as exc:
            raise VerifierError(f"rust toolchain unusable: {exc}", reason="toolchain_missing") from exc
        tools["rustc"] = os.path.join(sysroot, "bin", "rustc")
        binds = {sysroot} if not any(sysroot.startswith(p) for p in _SHOWN) else set()
    if language == "java":
        binds |= set(_linked_out(os.path.dirname(os.path.dirname(tools["java"]))))
    return Toolchain(language, tools, tuple(sorted(binds)))


@functools.cache
def _linked_out(home: str) -> tuple[str, ...]:
    """Top directories outside the sandbox's view that links under ``home`` point
    into (Debian's JDK keeps its configuration in /etc/java-N-openjdk)."""
    found = set()
    for parent, dirs, files in os.walk(home):
        for name in dirs + files:
            path = os.path.join(parent, name)
            if os.path.islink(path):
                target = os.path.realpath(path)
                if os.path.exists(target) and not any(target.startswith(p) for p in _SHOWN):
                    found.add("/".join(target.split("/")[:3]))
    return tuple(sorted(found))
