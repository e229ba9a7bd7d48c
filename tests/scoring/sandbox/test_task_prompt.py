"""The task's code in its prompt, as the checker runs it before a test: the code as
is, or found inside a chat template, a fence, or after a line of prose; never prose."""

from __future__ import annotations

import pytest

from stream_reward.scoring.sandbox.task_prompt import task_code

CODE = 'import math\n\n\ndef poly(xs, x):\n    return sum(c * math.pow(x, i) for i, c in enumerate(xs))\n\n\ndef find_zero(xs):\n    """A zero."""\n'


@pytest.mark.parametrize(
    "prompt",
    [
        CODE,
        f"<|im_start|>user\n{CODE}<|im_end|>\n<|im_start|>assistant\n",
        f"Complete this function:\n```python\n{CODE}```\nUse bisection.",
        f"<|im_start|>user\nComplete this function:\n```\n{CODE}```<|im_end|>\n",
        f"Complete the following Python function.\nKeep the signature.\n\n{CODE}",
    ],
    ids=["as_is", "templated_code", "fenced", "templated_fenced_untagged", "prose_then_code"],
)
def test_the_prompts_code_is_found_in_every_shape(prompt):
    assert task_code(prompt).strip() == CODE.strip()


@pytest.mark.parametrize(
    "prompt", [None, "", "Write a function that adds two numbers.", "Thanks", "```js\nvar x = 1\n```"]
)
def test_a_prompt_without_python_gives_no_code(prompt):
    assert task_code(prompt) == ""


def test_fenced_blocks_of_other_languages_are_left_out():
    prompt = f"```python\n{CODE}```\nIn JavaScript it would be:\n```js\nfunction poly() {{}}\n```"
    assert task_code(prompt).strip() == CODE.strip()
