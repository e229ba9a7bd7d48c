"""The CLI's ``produce`` of a batch id that exists exits 2 with a one-line hint, no traceback."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stream_reward.cli import main as cli_main

pytestmark = pytest.mark.anyio


def test_cli_produce_of_an_existing_batch_exits_2_with_a_hint(
    redis_url: str, namespace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text(json.dumps({"data_source": "test", "response": "a", "ground_truth": "a"}) + "\n")
    argv = ["produce", "--redis", redis_url, "--namespace", namespace, "--batch", "step-1", str(rollouts)]
    assert cli_main(argv) == 0
    capsys.readouterr()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "already" in err and "step-1" in err and "unique batch id" in err
    assert "Traceback" not in err
