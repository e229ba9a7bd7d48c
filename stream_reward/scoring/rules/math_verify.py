"""math-verify's verdict on a math answer, by verl's convention: what ``--scorer math-verify``
runs in its scorer processes.

HuggingFace's math-verify compares answers as mathematics (``0.5`` is ``\\frac12``,
``\\sqrt{12}`` is ``2\\sqrt3``; intervals, sets, percentages) where the ``rules`` MATH check
compares normalised strings. verl 0.9.1's ``verl.utils.reward_score.math_verify.compute_score``
is the reference, verdict for verdict: the ground truth wrapped in ``\\boxed{}`` and read
with ``LatexExtractionConfig``, the response read with ``ExprExtractionConfig`` and
``LatexExtractionConfig``, 1.0 if any pair verifies, else 0.0 (also when math-verify
cannot read the ground truth, as in verl).

Why processes: math-verify bounds its parsing and each comparison with ``signal.alarm``
(5 s each, its defaults, kept as verl keeps them), which only works in a process's main
thread, and sympy can still run long between those bounds. So ``--scorer math-verify``
runs ``compute_score`` in the pool of killable scorer processes, with the sample's
``timeout`` as a wall bound on the whole call.

Who loses: an answer too costly to compare (a tower of powers) is the policy's own output,
so it scores 0.0 with status ok and ``timeout: True`` in its extra info, whether
math-verify's own bounds caught it or the pool killed the process; masking it would teach
the policy to emit such answers. math-verify not installed is the host's fault: the sample
fails, with a message naming the extra to install.
"""

from __future__ import annotations

import logging
import threading
from typing import Any

from stream_reward.errors import MissingExtraError
from stream_reward.scoring.rules import ground_truth_text

__all__ = ["compute_score"]


class _TimeoutCount(logging.Filter):
    """Counts math-verify's own timeouts: it logs them ("Timeout during parsing: ...",
    "Timeout during comparison") and returns no match instead of raising. The sample's
    ``timeout`` key says it; the line itself is dropped, or a worker's log would carry one
    per unanswered sample. A filter on math-verify's logger, not a handler: only the
    program's entry point decides where log lines go."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def filter(self, record: logging.LogRecord) -> bool:
        if str(record.msg).startswith("Timeout during"):
            self.count += 1
            return False
        return True


_TIMEOUTS = _TimeoutCount()


def _verl_metric() -> tuple[Any, type[BaseException]] | None:
    """verl's metric, built once per process; None when math-verify is not installed."""
    try:
        from math_verify.errors import TimeoutException
        from math_verify.metric import math_metric
        from math_verify.parser import ExprExtractionConfig, LatexExtractionConfig
    except ImportError:
        return None
    source = logging.getLogger("math_verify")
    # Its warnings reach this counter even when the root logger is set above WARNING. A
    # logger's filter sees only the records logged on that logger, not those its children
    # pass up: every math-verify module's logger gets it (they exist once it is imported).
    source.setLevel(logging.WARNING)
    for name in [source.name, *logging.Logger.manager.loggerDict]:
        if name == source.name or name.startswith(source.name + "."):
            logging.getLogger(name).addFilter(_TIMEOUTS)
    metric = math_metric(
        gold_extraction_target=(LatexExtractionConfig(),),
        pred_extraction_target=(ExprExtractionConfig(), LatexExtractionConfig()),
    )
    return metric, TimeoutException


_METRIC = _verl_metric()


def compute_score(
    data_source: str,
    solution_str: str,
    ground_truth: Any,
    extra_info: dict[str, Any] | None = None,
    **kwargs: Any,
) -> dict[str, Any]:
    """``{"score": 1.0 | 0.0, "timeout": bool}`` for one sample; ``data_source``,
    ``extra_info`` and keyword arguments are accepted and ignored, as verl's function
    takes none of them. A number as ground truth compares as its string form."""
    if _METRIC is None:
        raise MissingExtraError("math-verify", "math", "--scorer math-verify")
    if threading.current_thread() is not threading.main_thread():
        # Off the main thread math-verify's alarms cannot be set: it would answer 0.0 for
        # every sample without saying why.
        raise RuntimeError("math-verify runs only in a main thread (signal.alarm): use --scorer math-verify")
    metric, timeout_exception = _METRIC
    gold = "\\boxed{" + ground_truth_text(ground_truth) + "}"
    before = _TIMEOUTS.count
    score, timed_out = 0.0, False
    try:
        score, _ = metric([gold], [solution_str])
    except timeout_exception:  # verl: its timeout_score, 0 by default
        timed_out = True
    except Exception:  # verl: a ground truth math-verify cannot read, any other error
        pass
    return {"score": float(score), "timeout": timed_out or _TIMEOUTS.count > before}
