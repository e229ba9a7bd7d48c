"""The last user turn of a prompt, in every shape a path delivers it: chat messages
(verl's ``raw_prompt``), a chat-templated text, a plain text."""

from __future__ import annotations

import numpy as np
import pytest

from stream_reward.scoring.prompts import undo_template, user_prompt

TASK = "Complete this function:\n```python\ndef f(x):\n    return x\n```"

TEMPLATED = {
    "chatml": f"<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\n{TASK}<|im_end|>\n<|im_start|>assistant\n",
    "llama3": (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nBe brief.<|eot_id|>"
        f"<|start_header_id|>user<|end_header_id|>\n\n{TASK}<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    ),
    "llama2": f"<s>[INST] <<SYS>>\nBe brief.\n<</SYS>>\n\n{TASK} [/INST]",
    "gemma": f"<bos><start_of_turn>user\n{TASK}<end_of_turn>\n<start_of_turn>model\n",
    "plain": f"System: Be brief.\nUser: {TASK}\nAssistant:",
    "multi_turn": (
        "<|im_start|>user\nhello<|im_end|>\n<|im_start|>assistant\nhi<|im_end|>\n"
        f"<|im_start|>user\n{TASK}<|im_end|>\n<|im_start|>assistant\n"
    ),
}


@pytest.mark.parametrize("name", list(TEMPLATED))
def test_a_chat_template_is_undone_to_the_last_user_turn(name):
    assert user_prompt(TEMPLATED[name]).strip() == TASK


def test_a_text_in_no_template_is_kept_less_the_special_tokens():
    assert undo_template("<s>def f(x):\n    return x", ["<s>"]) == "def f(x):\n    return x"
    assert user_prompt("What is 2 + 2?") == "What is 2 + 2?"


@pytest.mark.parametrize(
    "messages",
    [
        [{"role": "system", "content": "Be brief."}, {"role": "user", "content": TASK}],
        [
            {"role": "user", "content": "hello"},
            {"role": "assistant", "content": "hi"},
            {"role": "user", "content": TASK},
        ],
        [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": TASK}]}],
        np.array([{"role": "system", "content": "x"}, {"role": "user", "content": TASK}], dtype=object),
    ],
    ids=["system_user", "multi_turn", "content_parts", "numpy_column"],
)
def test_chat_messages_give_the_last_user_message(messages):
    assert user_prompt(messages) == TASK


@pytest.mark.parametrize("value", [None, [], [{"role": "system", "content": "x"}], {"role": "user"}, 3])
def test_no_user_turn_is_none(value):
    assert user_prompt(value) is None
