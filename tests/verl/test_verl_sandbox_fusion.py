"""verl 0.9.1's own SandboxFusion reward path, pointed at our ``POST /run_code``, gives
verl's scores: ``verl.utils.reward_score.sandbox_fusion.compute_score`` and
``default_compute_score`` (a code ``data_source`` with ``sandbox_fusion_url``) score a
correct program 1.0 and a wrong, crashing or timing-out one 0.0, on stdin/stdout
problems and on verl's call-based ``fn_name`` form, and read each case's status
(success, wrong_answer, runtime_error, timeout) from our replies as verl means it."""

from __future__ import annotations

import asyncio
import os
import threading
from collections.abc import Iterator

import pytest
from aiohttp import web
from verl.utils.reward_score import default_compute_score
from verl.utils.reward_score.sandbox_fusion import compute_score

from stream_reward.config import SandboxConfig
from stream_reward.gateway.run_code import RunCodeConfig, add_run_code_routes

UIDS = dict(uid_base=500_000 + (os.getpid() % 10_000) * 16, uid_count=16)


@pytest.fixture(scope="module")
def run_code_url() -> Iterator[str]:
    """``/run_code`` on loopback, served from a thread of its own: verl's client is
    synchronous (requests, in its own thread pool)."""
    loop = asyncio.new_event_loop()
    started: dict[str, str] = {}
    ready = threading.Event()
    stop = asyncio.Event()

    async def serve() -> None:
        app = web.Application()
        add_run_code_routes(app, RunCodeConfig(concurrency=2, max_run_timeout_s=5.0, sandbox=SandboxConfig(**UIDS)))
        runner = web.AppRunner(app)
        await runner.setup()
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        started["url"] = f"http://127.0.0.1:{runner.addresses[0][1]}/run_code"
        ready.set()
        try:
            await stop.wait()
        finally:
            await runner.cleanup()

    thread = threading.Thread(target=loop.run_until_complete, args=(serve(),), daemon=True)
    thread.start()
    assert ready.wait(120), "the /run_code server did not start"
    try:
        yield started["url"]
    finally:
        loop.call_soon_threadsafe(stop.set)
        thread.join(60)
        loop.close()


def fenced(code: str) -> str:
    return f"Here is my solution.\n```python\n{code}\n```\n"


DOUBLE = {"inputs": ["2\n", "5\n", "-3\n"], "outputs": ["4\n", "10\n", "-6\n"]}
ADD = {"fn_name": "add", "inputs": ["1\n2", "3\n4"], "outputs": ["3", "7"]}


def score(url: str, completion: str, tests: dict, timeout: int = 3) -> tuple[float, list[dict]]:
    return compute_score(url, threading.Semaphore(4), 256, completion, tests, timeout=timeout)


def test_correct_program_scores_one(run_code_url):
    value, meta = score(run_code_url, fenced("print(int(input()) * 2)"), DOUBLE)
    assert value == 1.0
    assert [m["status"] for m in meta] == ["success"] * 3
    assert all(m["api_status"] == "Success" and m["run_status"] == "Finished" for m in meta)


def test_wrong_program_scores_zero(run_code_url):
    value, meta = score(run_code_url, fenced("print(int(input()) * 3)"), DOUBLE)
    assert value == 0.0
    assert [m["status"] for m in meta] == ["wrong_answer"] * 3


def test_partly_right_program_scores_its_fraction(run_code_url):
    value, _ = score(run_code_url, fenced("x = int(input())\nprint(x * 2 if x > 0 else 0)"), DOUBLE)
    assert value == pytest.approx(2 / 3)


def test_crashing_program_scores_zero_as_runtime_error(run_code_url):
    value, meta = score(run_code_url, fenced("raise SystemExit(int(input()) or 1)"), DOUBLE)
    assert value == 0.0
    assert {m["status"] for m in meta} == {"runtime_error"}
    assert all(m["api_status"] == "Failed" and m["exit_code"] != 0 for m in meta)


def test_timing_out_program_scores_zero_as_timeout(run_code_url):
    value, meta = score(
        run_code_url, fenced("while True:\n    pass"), {"inputs": ["1\n"], "outputs": ["1\n"]}, timeout=1
    )
    assert value == 0.0
    assert meta[0]["status"] == "timeout" and meta[0]["run_status"] == "TimeLimitExceeded"


def test_call_based_form_scores_through_verls_own_wrapper(run_code_url):
    right, meta = score(run_code_url, fenced("def add(a, b):\n    return a + b"), ADD)
    assert right == 1.0, meta
    wrong, _ = score(run_code_url, fenced("def add(a, b):\n    return a * b"), ADD)
    assert wrong == 0.0
    method, _ = score(run_code_url, fenced("class Solution:\n    def add(self, a, b):\n        return a + b"), ADD)
    assert method == 1.0


def test_default_compute_score_routes_code_sources_to_run_code(run_code_url):
    for source in ("codecontests", "apps", "codeforces", "taco"):
        right = default_compute_score(
            source, fenced("print(int(input()) * 2)"), DOUBLE, sandbox_fusion_url=run_code_url, memory_limit_mb=256
        )
        wrong = default_compute_score(
            source, fenced("print(int(input()) - 1)"), DOUBLE, sandbox_fusion_url=run_code_url, memory_limit_mb=256
        )
        assert (right, wrong) == (1.0, 0.0), source


def test_response_without_code_block_scores_zero(run_code_url):
    value, meta = score(run_code_url, "I think the answer is 4.", DOUBLE)
    assert value == 0.0 and "missing code block" in meta[0]["error"]
