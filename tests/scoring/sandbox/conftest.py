"""Sandbox fixtures: scorers that are closed after their test or module, and the
check that no sandboxed process outlives its run."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest
from sandbox_hacks import LIMITS
from sandbox_support import sandboxed_processes, scorer_or_skip

from stream_reward.scoring.sandbox.scorer import SandboxScorer


@pytest.fixture(scope="module", params=["bwrap", "unshare"])
def scorer(request: pytest.FixtureRequest) -> Iterator[SandboxScorer]:
    """One scorer per backend with the ``FAST`` limits, kept for the module (its slots
    are persistent sandboxes)."""
    s = scorer_or_skip(backend=request.param)
    yield s
    s.close()


@pytest.fixture(scope="module")
def bwrap() -> Iterator[SandboxScorer]:
    s = scorer_or_skip(backend="bwrap")
    yield s
    s.close()


@pytest.fixture(scope="module", params=["bwrap", "unshare"])
def hack_scorer(request: pytest.FixtureRequest) -> Iterator[SandboxScorer]:
    """One scorer per backend with the hack table's limits, kept for the module."""
    s = scorer_or_skip(LIMITS, backend=request.param)
    yield s
    s.close()


@pytest.fixture
def open_scorer() -> Iterator[Callable[..., SandboxScorer]]:
    """``open_scorer(**limits)``: a scorer of the test's own, closed after it."""
    opened: list[SandboxScorer] = []

    def open_(**kw: Any) -> SandboxScorer:
        s = scorer_or_skip(**kw)
        opened.append(s)
        return s

    yield open_
    for s in opened:
        s.close()


@pytest.fixture
def no_sandboxed_process_left(open_scorer: Callable[..., SandboxScorer]) -> Iterator[None]:
    """A case's processes die with the case; the slots (harnesses) with their scorer.
    Checked before ``open_scorer`` closes the test's scorers (it depends on it for that
    order), so that closing cannot hide a process a run left behind."""
    yield
    assert sandboxed_processes(slots=False) == [], "a sandboxed process outlived its run"
