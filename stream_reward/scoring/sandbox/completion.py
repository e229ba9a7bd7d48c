"""The program a Python response stands for: the prompt's code in front of it.

HumanEval-style tasks give the start of a program in the ``prompt`` (imports,
helpers such as ``poly``, the signature and docstring of the function to write),
and their own harness runs ``prompt + completion``. A response may be only that
completion (the function's body), or a whole function that calls a helper it
did not copy from the prompt: both are right answers, and both need the
prompt's code in the candidate's process. The checker runs the prompt too, in
its own process, for the tests' use; this is the candidate's copy.

The prompt goes in front only when it is code (every statement of it an
import, a definition, an assignment or a docstring) and the two parse together:
a prose or chat prompt, or one that would run something, leaves the response
alone.
"""

from __future__ import annotations

import ast

__all__ = ["whole_program"]

_DEFINITIONS = (
    ast.Import,
    ast.ImportFrom,
    ast.FunctionDef,
    ast.AsyncFunctionDef,
    ast.ClassDef,
    ast.Assign,
    ast.AnnAssign,
)


def whole_program(prompt: str | None, code: str) -> str:
    """``prompt + code`` when the prompt is the start of the program, else ``code``."""
    if not prompt or not prompt.strip():
        return code
    head = prompt if prompt.endswith("\n") else prompt + "\n"
    try:
        tree = ast.parse(head + code)
    except (SyntaxError, ValueError):  # ValueError: a NUL byte
        return code
    prompt_lines = head.count("\n")
    for node in tree.body:
        if node.lineno > prompt_lines:
            break
        docstring = isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant)
        if not (docstring or isinstance(node, _DEFINITIONS)):
            return code
    return head + code
