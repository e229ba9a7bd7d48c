"""`stream-reward score` end to end on the verl reference cases (``rules_cases.py`` beside
this file): the CLI gives the same scores as verl 0.9.1, row for row in input order, and a
bad line or an unknown data source fails its own row only."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

from stream_reward.cli import main

_spec = importlib.util.spec_from_file_location("rules_cases", Path(__file__).with_name("rules_cases.py"))
rules_cases = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rules_cases)


def test_score_command_matches_verl_reference_scores(tmp_path, capsys):
    src = tmp_path / "rollouts.jsonl"
    lines = [
        json.dumps(
            {
                "uid": case.id,
                "data_source": case.data_source,
                "response": case.solution_str,
                "ground_truth": case.ground_truth,
                "unknown_field": 1,
            }
        )
        for case in rules_cases.CASES
    ]
    bad_line = len(lines)
    lines.append("{not json")
    unknown = len(lines)
    lines.append(json.dumps({"data_source": "nowhere/else", "response": "#### 1", "ground_truth": "1"}))
    src.write_text("\n".join(lines) + "\n")
    out = tmp_path / "scores.jsonl"

    assert main(["score", str(src), "--out", str(out)]) == 0
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [row["index"] for row in rows] == list(range(len(lines)))  # input order
    for case, row in zip(rules_cases.CASES, rows):
        expected = rules_cases.OURS.get(case.id, case.expected)
        if expected == "bad_ground_truth":  # never a silent 0 because of a type
            assert (row["status"], row["reason"]) == ("failed", expected), case.id
            continue
        assert row["status"] == "ok", (case.id, row)
        assert row["uid"] == case.id
        if isinstance(expected, dict):  # math_dapo: score plus acc/pred columns
            assert row["score"] == expected["score"], case.id
            assert row["reward_extra_info"]["acc"] == expected["acc"], case.id
            assert row["reward_extra_info"]["pred"] == expected["pred"], case.id
        else:
            assert row["score"] == expected, case.id
    assert rows[bad_line]["status"] == "failed" and rows[bad_line]["score"] is None
    assert f"line {bad_line + 1}" in rows[bad_line]["error"]
    assert rows[unknown]["status"] == "failed" and "nowhere/else" in rows[unknown]["error"]
    assert f"line {bad_line + 1}" in capsys.readouterr().err  # reported when read, too
