"""The task's code the trusted checker runs before a test: the Python in its prompt.

A HumanEval test calls helpers its prompt defines (``poly``, ``encode_cyclic``): the
checker takes them from the prompt, never from the response. The prompt comes from
the ground truth's own ``prompt`` when it has one (what a dataset can always give),
else from the trajectory's ``prompt``, in whatever shape the path delivered it: the
task's code as is (JSONL), a chat-templated text, or a user message that wraps the
code in a fence or puts a line of prose in front of it.
"""

from __future__ import annotations

import ast

from stream_reward.scoring.prompts import undo_template
from stream_reward.scoring.sandbox.languages import canonical, fenced_blocks

__all__ = ["task_code"]

_PROSE_LINES = 64  # prose lines tried in front of unfenced code
_MAX_SEARCH = 64 << 10  # longer prompts are not searched line by line


def task_code(prompt: str | None) -> str:
    """The Python the task's ``prompt`` defines, "" when it holds none."""
    if not prompt:
        return ""
    if _defines(prompt):
        return prompt
    text = undo_template(prompt)
    if _defines(text):
        return text
    blocks = [body for tag, body in fenced_blocks(text) if canonical(tag or "python") == "python" and _defines(body)]
    if blocks:
        return "\n\n".join(blocks)
    if len(text) <= _MAX_SEARCH:
        lines = text.splitlines(keepends=True)
        for start in range(1, min(len(lines), _PROSE_LINES)):
            tail = "".join(lines[start:])
            if _defines(tail):
                return tail
    return ""


def _defines(code: str) -> bool:
    """Python that defines something (a bare word of prose parses as an expression)."""
    try:
        tree = ast.parse(code)
    except (SyntaxError, ValueError):
        return False
    return any(
        isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef, ast.Import, ast.ImportFrom, ast.Assign))
        for node in tree.body
    )
