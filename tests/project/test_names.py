"""The names users depend on: every flag documented with its default, every command the docs
name exists, and old spellings still accepted with a warning."""

from __future__ import annotations

import argparse
import re
import shlex
from pathlib import Path

import pytest

from stream_reward.cli import build_parser, main
from stream_reward.errors import ConfigDeprecationWarning
from stream_reward.ops.worker_cli import DeprecatedFlag

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


def _commands(
    parser: argparse.ArgumentParser, path: tuple[str, ...] = ()
) -> dict[tuple[str, ...], argparse.ArgumentParser]:
    found = {path: parser}
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for name, sub in action.choices.items():
                found.update(_commands(sub, (*path, name)))
    return found


COMMANDS = _commands(build_parser())
# Programs other than stream-reward that the docs show with flags.
OTHER_PROGRAMS = {"stream-reward", "redis-cli", "redis-server", "python", "pip", "bwrap", "openssl", "pytest"}


@pytest.mark.parametrize("path", sorted(COMMANDS), ids=lambda p: " ".join(p) or "stream-reward")
def test_every_flag_has_a_help_line_with_its_default(path: tuple[str, ...]) -> None:
    missing = []
    for action in COMMANDS[path]._actions:
        if isinstance(action, (argparse._HelpAction, argparse._VersionAction, argparse._SubParsersAction)):
            continue
        if isinstance(action, DeprecatedFlag):
            continue  # hidden on purpose: the new spelling has the line
        name = "/".join(action.option_strings) or action.dest
        if not action.help or action.help is argparse.SUPPRESS:
            missing.append(f"{name}: no help")
        elif action.option_strings and not action.required and not isinstance(action, argparse._StoreTrueAction):
            # positionals, required flags and switches have no default to show
            if "default" not in action.help:
                missing.append(f"{name}: no default in {action.help!r}")
    assert missing == [], f"stream-reward {' '.join(path)}"


def _code(doc: Path) -> str:
    """The code of a markdown file: its fenced blocks and inline code spans."""
    text = doc.read_text()
    blocks = re.findall(r"```[a-z]*\n(.*?)```", text, re.S)
    spans = re.findall(r"`([^`\n]+)`", re.sub(r"```.*?```", "", text, flags=re.S))
    return "\n".join(blocks + spans)


def _documented_commands() -> set[tuple[str, ...]]:
    """Each ``stream-reward X [Y]`` the docs' code names, as the longest known command path
    (a first word that is no command is kept as is, and fails the test)."""
    found = set()
    for doc in DOCS:
        for match in re.finditer(r"stream-reward((?: [a-z][a-z-]*)+)", _code(doc)):
            words = match.group(1).split()
            path: tuple[str, ...] = (words[0],)
            for word in words[1:]:
                if (*path, word) not in COMMANDS:
                    break
                path = (*path, word)
            found.add(path)
        # A command shown without its program: `dlq list --partitions P`.
        text = re.sub(r"```.*?```", "", doc.read_text(), flags=re.S)
        for span in re.findall(r"`([^`\n]+)`", text):
            bare = re.match(r"([a-z][a-z-]*)(?: [a-z/]+)* --[a-z]", span)
            if bare and bare.group(1) not in OTHER_PROGRAMS:
                found.add((bare.group(1),))
    return found


def test_docs_name_only_commands_that_exist(capsys: pytest.CaptureFixture[str]) -> None:
    documented = _documented_commands()
    assert ("dlq",) in documented or ("dlq", "list") in documented  # the scan sees the docs at all
    for path in sorted(documented):
        assert path in COMMANDS, f"the docs name `stream-reward {' '.join(path)}`, which does not exist"
        with pytest.raises(SystemExit) as exit_:
            main([*path, "--help"])
        assert exit_.value.code == 0, path
        capsys.readouterr()


def test_help_names_every_scorer_and_url_scheme(capsys: pytest.CaptureFixture[str]) -> None:
    for path in (("worker",), ("score",), ("demo",)):
        with pytest.raises(SystemExit):
            main([*path, "--help"])
        out = " ".join(capsys.readouterr().out.split())
        assert "redis+cluster://" in out, path
    with pytest.raises(SystemExit):
        main(["worker", "--help"])
    out = " ".join(capsys.readouterr().out.split())
    for kind in ("rules", "python:", "http", "disrm", "genrm", "sandbox"):
        assert kind in out, kind


@pytest.mark.parametrize(
    ("argv", "old", "new", "dest", "value"),
    [
        (["worker", "--max-inflight", "4"], "--max-inflight", "--max-concurrent", "max_concurrent", 4),
        (["collect", "--batch", "b", "--timeout", "7"], "--timeout", "--timeout-s", "timeout_s", 7.0),
        (["score", "f.jsonl", "--timeout", "7"], "--timeout", "--timeout-s", "timeout_s", 7.0),
    ],
)
def test_old_flag_spellings_work_with_a_warning(argv: list[str], old: str, new: str, dest: str, value: object) -> None:
    with pytest.warns(ConfigDeprecationWarning, match=f"{old} is deprecated; use {new}"):
        args = build_parser().parse_args(argv)
    assert getattr(args, dest) == value


def test_docs_commands_parse(capsys: pytest.CaptureFixture[str]) -> None:
    """Every ``stream-reward ...`` line in a docs code block parses (flags and all)."""
    parser = build_parser()
    for doc in DOCS:
        for block in re.findall(r"```(?:bash|sh|console)?\n(.*?)```", doc.read_text(), re.S):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split("#", 1)[0].strip().removeprefix("$ ")
                if ".venv/bin/stream-reward " in line:
                    line = line[line.index(".venv/bin/stream-reward ") :].replace(".venv/bin/", "")
                skip = ("|", "<", "...", "   ")  # pipes, placeholders, elisions, diagrams
                if not line.startswith("stream-reward ") or any(x in line for x in skip):
                    continue
                argv = shlex.split(line.split("&&")[0])[1:]
                if argv and argv[0] == "bench":
                    continue  # the bench parses its own flags
                try:
                    parser.parse_args(argv)
                except SystemExit as exc:
                    pytest.fail(f"{doc.name}: `{line}` does not parse ({exc.code}): {capsys.readouterr().err}")


@pytest.mark.parametrize("manager", ["naive", "dapo", "prime"])
def test_a_workers_scorer_is_named_by_its_spec_not_a_wrapper_class(manager: str) -> None:
    from stream_reward.config import ManagerConfig
    from stream_reward.scoring.registry import build_scorer

    scorer = build_scorer(ManagerConfig(manager=manager, scorer="rules"))
    assert getattr(scorer, "name", None) == "rules"
