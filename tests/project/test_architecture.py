"""The package's shape: imports go one way, with no cycles between modules or between stages.

Every import counts, including the ones inside functions and under ``TYPE_CHECKING``:
those are where cycles used to hide.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIBRARY = "stream_reward"

# The stages, lowest first: a stage may import only from stages listed before it (and itself).
# ``_version`` (a constant), ``errors`` and ``config`` are the base every stage stands on; the CLI and the verl
# integration (and the TRL front door, the gateway) sit on top of everything.
STAGES = [
    "_version",
    "errors",
    "config",
    "wire",
    "scoring",
    "trainer",
    "ops",
    "worker",
    "verl",
    "trl",
    "gateway",
    "bench",
    "cli",
]


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path) -> set[str]:
    """Absolute names of the project modules ``path`` imports, anywhere in the file."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                module = ".".join(base + ([node.module] if node.module else []))
            else:
                module = node.module or ""
            found.add(module)
            found.update(f"{module}.{alias.name}" for alias in node.names)
    return {m for m in found if m.split(".")[0] in (LIBRARY, "workers")}


def _graph() -> dict[str, set[str]]:
    paths = [p for top in (LIBRARY, "workers") for p in (ROOT / top).rglob("*.py")]
    modules = {_module_name(p): p for p in paths}
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        # ``from pkg import module`` names a module; ``from module import attr`` names the module.
        targets = {m if m in modules else m.rsplit(".", 1)[0] for m in _imports(path)}
        graph[name] = {t for t in targets if t in modules and t != name}
    return graph


def _stage(module: str) -> str | None:
    parts = module.split(".")
    if parts[0] != LIBRARY or len(parts) < 2:
        return None  # the package root re-exports the public API; workers/ is outside the library
    return parts[1]


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = 1
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == 1:
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = 2
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_no_module_import_cycles():
    graph = {m: {t for t in ts if t != LIBRARY} for m, ts in _graph().items() if m != LIBRARY}
    assert _find_cycle(graph) is None


def test_stages_import_downward_only():
    wrong = []
    for module, targets in _graph().items():
        here = _stage(module)
        if here is None:
            continue
        for target in targets:
            there = _stage(target)
            if target == LIBRARY and here == "bench":
                continue  # a bench imports the public package as a user does, to measure it
            if target == LIBRARY or target.split(".")[0] == "workers":
                wrong.append(f"{module} -> {target}")  # the library never imports its root or workers/
            elif there is not None and STAGES.index(there) > STAGES.index(here):
                wrong.append(f"{module} -> {target}")
    assert wrong == []


def test_workers_import_only_the_library_and_themselves():
    graph = _graph()
    for module, targets in graph.items():
        if module.startswith("workers"):
            assert all(t.split(".")[0] in (LIBRARY, "workers") for t in targets)


def test_the_checker_sees_a_cycle():
    assert _find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert _find_cycle({"a": {"b"}, "b": set()}) is None
