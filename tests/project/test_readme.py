"""The README's commands and examples, exercised so they cannot go stale."""

from __future__ import annotations

import asyncio
import re
import shlex
from pathlib import Path

import pytest

from stream_reward.cli import build_parser, main
from stream_reward.errors import BatchExistsError
from stream_reward.ops.embedded import EmbeddedServer

ROOT = Path(__file__).resolve().parents[2]
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), ROOT / "benchmarks" / "README.md"]


def code_blocks(path: Path, lang: str) -> list[str]:
    return re.findall(rf"```{lang}\n(.*?)```", path.read_text(), flags=re.S)


def cli_lines() -> list[tuple[str, str]]:
    """Every `stream-reward ...` command in a bash block of the README and docs."""
    found = []
    for path in DOCS:
        if not path.exists():
            continue
        for block in code_blocks(path, "bash"):
            for line in block.replace("\\\n", " ").splitlines():
                line = line.split(" #", 1)[0].strip()
                match = re.search(r"(?:^|/|\s)stream-reward (.*)", line)
                if match:
                    found.append((path.name, match.group(1)))
    return found


def test_readme_has_the_two_commands():
    readme = (ROOT / "README.md").read_text()
    assert "scripts/setup.sh && .venv/bin/stream-reward demo" in readme
    tests_command = "scripts/setup.sh && .venv/bin/python -m pytest -q"
    assert tests_command in readme
    assert tests_command in (ROOT / ".ci" / "run").read_text()  # CI runs exactly the README's test command


@pytest.mark.parametrize(("doc", "command"), cli_lines())
def test_documented_commands_parse(doc, command):
    argv = shlex.split(command.split("&&")[0])
    build_parser().parse_args(argv)  # SystemExit here means a documented command or flag is gone


def test_readme_trainer_example_runs(spawn_workers):
    (example,) = [b for b in code_blocks(ROOT / "README.md", "python") if "async def rollout_step" in b]
    scope: dict = {}
    exec(compile(example, "README.md", "exec"), scope)
    samples = [
        {
            "data_source": "openai/gsm8k",
            "response": f"... #### {i}",
            "ground_truth": str(i if i % 2 else i + 1),
            "n_tokens": 5 + i,
            "prompt_id": f"p{i // 4}",
        }
        for i in range(8)
    ]
    with EmbeddedServer() as server:
        spawn_workers(1, url=server.url, ns="sr")
        rewards = asyncio.run(scope["rollout_step"](server.url, "run-a", 17, samples))
        with pytest.raises(BatchExistsError):  # the same step again: refused, never the old rewards
            asyncio.run(scope["rollout_step"](server.url, "run-a", 17, samples))
    assert rewards.scores == [0.0, 1.0] * 4
    assert rewards.rm_scores.shape == (8, 1024)
    assert [rewards.rm_scores[i, 4 + i].item() for i in range(8)] == rewards.scores


def test_demo_command_small(capsys):
    assert main(["demo", "--n", "300", "--generation-s", "0.3"]) == 0
    out = capsys.readouterr().out
    for field in ("status:", "accuracy:", "throughput:", "reward tail:", "rm_scores:"):
        assert field in out
    assert "{'ok': 300}" in out
