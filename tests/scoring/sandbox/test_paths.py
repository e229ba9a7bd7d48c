"""The verifier's tables through ``stream-reward score --scorer sandbox``: each row of
``sandbox_table.path_rows()`` scores on the command line what the scorer's own tests
pin — the task's prompt read from the JSONL's ``prompt``, the language from the
fence, every wrong program 0.0 and every right one 1.0 with status ``ok``, and a
sample we cannot judge ``failed`` with its reason, never a score."""

from __future__ import annotations

import json
from pathlib import Path

from sandbox_hacks import LIMITS
from sandbox_table import Row, path_rows

from stream_reward.cli import main


def expected(row: Row) -> tuple[str, object]:
    return ("failed", row.reason) if row.reason else ("ok", row.score)


def test_every_table_row_scores_the_same_through_stream_reward_score(tmp_path: Path) -> None:
    rows = path_rows()
    src = tmp_path / "table.jsonl"
    src.write_text(
        "".join(
            json.dumps(
                {
                    "uid": row.uid,
                    "data_source": "code",
                    "prompt": row.prompt,
                    "response": row.response,
                    "ground_truth": row.ground_truth_json,
                }
            )
            + "\n"
            for row in rows
        )
    )
    config = tmp_path / "sr.toml"
    config.write_text("[reward.sandbox]\n" + "".join(f"{key} = {value!r}\n" for key, value in LIMITS.items()))
    out = tmp_path / "scores.jsonl"

    argv = ["score", str(src), "--scorer", "sandbox", "--config", str(config), "--out", str(out)]
    assert main([*argv, "--timeout-s", "900"]) == 0

    results = {r["uid"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert sorted(results) == sorted(row.uid for row in rows)
    got = {}
    for row in rows:
        r = results[row.uid]
        got[row.uid] = (r["status"], r["score"] if r["status"] == "ok" else r["reason"])
    assert got == {row.uid: expected(row) for row in rows}
