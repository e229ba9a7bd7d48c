"""SandboxFusionScorer, the client of a remote SandboxFusion server: every test form
scores as the local sandbox does and a program's failure (wrong, crashing, too slow) is
a wrong answer; the sandbox's faults (SandboxError, 5xx, 429, a hang, a refused
connection) are retried, then raised as ``VerifierError`` — never a 0; an unreadable
reply or a 4xx is a data fault, not retried; ``aclose`` closes the session, twice too.

Checked against a stub server on loopback that really runs each program
(``python -I -c``) and answers in SandboxFusion's format; a queue of injected faults
(HTTP 500, 429, SandboxError, a hang, garbage) is served first.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import socket
import sys
import time

import pytest
from aiohttp import web

from stream_reward.errors import BadReplyError, ConfigError, ScoringError, VerifierError
from stream_reward.scoring.sandbox.fusion import SandboxFusionConfig, SandboxFusionScorer
from stream_reward.wire.trajectory import Trajectory

FAST = dict(backoff_base_s=0.01, backoff_max_s=0.05, retries=2, run_timeout_s=2.0, request_timeout_s=5.0)


class Stub:
    def __init__(self, faults: list[str] | None = None) -> None:
        self.faults = list(faults or [])
        self.requests: list[dict] = []
        self.released = asyncio.Event()  # a hung request answers only when the stub closes

    async def run_code(self, request: web.Request) -> web.StreamResponse:
        body = await request.json()
        self.requests.append(body)
        fault = self.faults.pop(0) if self.faults else None
        if fault == "500":
            return web.Response(status=500, text="boom")
        if fault == "429":
            return web.Response(status=429, headers={"Retry-After": "0"})
        if fault == "400":
            return web.Response(status=400, text="bad field")
        if fault == "garbage":
            return web.Response(text="<html>not json</html>")
        if fault == "sandbox_error":
            return web.json_response({"status": "SandboxError", "message": "container crashed", "run_result": None})
        if fault == "hang":
            await self.released.wait()  # past any client timeout, and shutdown stays quick
        proc = await asyncio.create_subprocess_exec(
            sys.executable,
            "-I",
            "-c",
            body["code"],
            stdin=asyncio.subprocess.PIPE,
            stdout=asyncio.subprocess.PIPE,
            stderr=asyncio.subprocess.PIPE,
        )
        start = time.monotonic()
        try:
            out, err = await asyncio.wait_for(proc.communicate(body["stdin"].encode()), body["run_timeout"])
        except asyncio.TimeoutError:
            proc.kill()
            await proc.wait()
            run = {
                "status": "TimeLimitExceeded",
                "execution_time": body["run_timeout"],
                "return_code": None,
                "stdout": "",
                "stderr": "",
            }
            return web.json_response({"status": "Failed", "message": "", "compile_result": None, "run_result": run})
        run = {
            "status": "Finished",
            "execution_time": time.monotonic() - start,
            "return_code": proc.returncode,
            "stdout": out.decode(),
            "stderr": err.decode(),
        }
        status = "Success" if proc.returncode == 0 else "Failed"
        return web.json_response({"status": status, "message": "", "compile_result": None, "run_result": run})


@contextlib.asynccontextmanager
async def serve(stub: Stub):
    app = web.Application()
    app.router.add_post("/run_code", stub.run_code)
    runner = web.AppRunner(app)
    await runner.setup()
    site = web.TCPSite(runner, "127.0.0.1", 0)
    await site.start()
    port = runner.addresses[0][1]
    try:
        yield f"http://127.0.0.1:{port}"
    finally:
        stub.released.set()
        await runner.cleanup()


def traj(code: str, gt) -> Trajectory:
    return Trajectory(
        batch_id="b", index=0, data_source="code", response=f"```python\n{code}\n```", ground_truth=json.dumps(gt)
    )


def run_with(stub: Stub, *trajs: Trajectory, **cfg):
    async def go():
        async with serve(stub) as url:
            async with SandboxFusionScorer(url, SandboxFusionConfig(**{**FAST, **cfg})) as scorer:
                return [await scorer.score(t) for t in trajs]

    return asyncio.run(go())


ECHO = traj("print(int(input()) * 2)", {"inputs": ["2", "5"], "outputs": ["4", "10"]})


def test_success_for_every_form_and_request_fields():
    stub = Stub()
    results = run_with(
        stub,
        ECHO,
        traj("def add(a, b):\n    return a + b", {"fn_name": "add", "inputs": [[1, 2], [2, 2]], "outputs": [3, 4]}),
        traj("def sq(x):\n    return x * x", {"assert_case": ["assert sq(3) == 9"]}),
        traj("def inc(x):\n    return x + 1", {"test": "def check(c):\n    assert c(1) == 2", "entry_point": "inc"}),
    )
    assert [r.score for r in results] == [1.0] * 4
    assert results[0].extra == {"cases": ["passed", "passed"], "passed": 2, "total": 2, "error": ""}
    first = stub.requests[0]
    assert set(first) == {"code", "language", "compile_timeout", "run_timeout", "memory_limit_MB", "stdin"}
    assert first["language"] == "python" and first["stdin"] in ("2", "5") and first["memory_limit_MB"] == 1024


def test_failed_is_a_wrong_answer_not_an_error():
    results = run_with(
        Stub(),
        traj("print(int(input()) + 2)", {"inputs": ["2", "5"], "outputs": ["4", "10"]}),
        traj("def add(a, b):\n    return a - b", {"fn_name": "add", "inputs": [[1, 0], [1, 2]], "outputs": [1, 3]}),
        traj("def sq(x):\n    raise ValueError(x)", {"assert_case": ["assert sq(3) == 9"]}),
        traj("import time\ntime.sleep(10)", {"inputs": [""], "outputs": [""]}),
        traj("x = 1", {"assert_case": ["assert x == 2"]}),
    )
    assert results[0].extra["cases"] == ["passed", "failed"]
    assert results[1].extra["cases"] == ["passed", "failed"]
    assert results[2].extra["cases"] == ["runtime_error"] and "ValueError" in results[2].extra["error"]
    assert results[3].extra["cases"] == ["timeout"]
    assert results[4].extra["cases"] == ["failed"]


@pytest.mark.parametrize("fault", ["sandbox_error", "500", "429", "hang"])
def test_transient_faults_are_retried(fault):
    stub = Stub([fault])
    # The hung request ends only by the client's timeout; the retry, a real program run,
    # must fit in the same timeout on a loaded machine.
    cfg = {"request_timeout_s": 3.0} if fault == "hang" else {}
    (result,) = run_with(stub, traj("print(input())", {"inputs": ["hi"], "outputs": ["hi"]}), **cfg)
    assert result.score == 1.0
    assert len(stub.requests) == 2


@pytest.mark.parametrize(
    ("fault", "reason"), [("sandbox_error", "sandbox_error"), ("500", "http_500"), ("429", "http_429")]
)
def test_persistent_faults_raise_verifier_error_never_zero(fault, reason):
    stub = Stub([fault] * 10)
    with pytest.raises(VerifierError) as info:
        run_with(stub, traj("print(input())", {"inputs": ["hi"], "outputs": ["hi"]}))
    assert info.value.reason == reason
    assert info.value.attempts == 3
    assert len(stub.requests) == 3


def test_connection_refused_is_verifier_error():
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    sock.close()  # nothing listens there now

    async def go():
        async with SandboxFusionScorer(f"http://127.0.0.1:{port}", SandboxFusionConfig(**FAST)) as scorer:
            await scorer.score(ECHO)

    with pytest.raises(VerifierError) as info:
        asyncio.run(go())
    assert info.value.reason == "connect" and info.value.attempts == 3


def test_bad_replies_and_rejections_are_data_faults_not_retried():
    stub = Stub(["garbage"])
    with pytest.raises(BadReplyError) as info:
        run_with(stub, traj("print(1)", {"inputs": [""], "outputs": ["1"]}))
    assert info.value.reason == "bad_json" and len(stub.requests) == 1
    stub = Stub(["400"])
    with pytest.raises(BadReplyError) as info:
        run_with(stub, traj("print(1)", {"inputs": [""], "outputs": ["1"]}))
    assert info.value.reason == "http_400" and len(stub.requests) == 1


def test_sample_errors_and_config():
    with pytest.raises(ScoringError) as info:
        run_with(Stub(), Trajectory(batch_id="b", index=0, data_source="code", response="no code", ground_truth="{}"))
    assert info.value.reason in ("no_code", "bad_tests")
    with pytest.raises(ScoringError) as info:
        run_with(Stub(), traj("print(1)", {"weird": 1}))
    assert info.value.reason == "bad_tests"
    with pytest.raises(ConfigError):
        SandboxFusionScorer("localhost:8080")
    with pytest.raises(ConfigError):
        SandboxFusionConfig(retries=-1)


def test_all_or_nothing_and_aclose():
    async def go():
        async with serve(Stub()) as url:
            scorer = SandboxFusionScorer(url, SandboxFusionConfig(**FAST, all_or_nothing=True))
            r = await scorer.score(traj("print(int(input()) + 2)", {"inputs": ["2", "5"], "outputs": ["4", "10"]}))
            session = scorer._session
            await scorer.aclose()
            assert session is not None and session.closed
            await scorer.aclose()  # idempotent
            return r

    assert asyncio.run(go()).score == 0.0


HELPER_PROMPT = 'def helper(x):\n    return x * 2\n\n\ndef f(x):\n    """Twice x, plus one."""\n'
HELPER_CHECK = {"test": "def check(candidate):\n    assert candidate(3) == 7\n", "entry_point": "f"}


def test_a_completion_runs_after_the_tasks_prompt():
    """HumanEval's responses are completions of the prompt's function: the prompt (the
    ground truth's, else the sample's) goes in front, as on the local sandbox."""
    body = "    return helper(x) + 1"
    in_gt = traj(body, {**HELPER_CHECK, "prompt": HELPER_PROMPT})
    in_sample = Trajectory(
        batch_id="b",
        index=1,
        data_source="code",
        prompt=HELPER_PROMPT,
        response=f"```python\n{body}\n```",
        ground_truth=json.dumps(HELPER_CHECK),
    )
    wrong = traj("    return helper(x)", {**HELPER_CHECK, "prompt": HELPER_PROMPT})
    assert [r.score for r in run_with(Stub(), in_gt, in_sample, wrong)] == [1.0, 1.0, 0.0]


def test_a_program_goes_in_its_own_language():
    """The block's language (its fence tag, or the task's) names SandboxFusion's runtime;
    a compiled language runs the stdin form only, and any other form is its loss."""
    stub = Stub()
    sums = {"inputs": ["2 3"], "outputs": ["5"]}

    def fenced(tag: str, code: str, gt) -> Trajectory:
        return Trajectory(
            batch_id="b", index=0, data_source="code", response=f"```{tag}\n{code}\n```", ground_truth=json.dumps(gt)
        )

    results = run_with(
        stub,
        fenced("cpp", "int main() {}", sums),
        fenced("js", "console.log(5)", sums),
        fenced("rust", "fn main() {}", {"assert_case": ["assert f() == 1"]}),
    )
    assert [r["language"] for r in stub.requests] == ["cpp", "nodejs"]
    assert results[2].score == 0.0 and "rust runs only in the stdin form" in results[2].extra["error"]
    with pytest.raises(ScoringError, match="SandboxFusion has no runtime for c") as info:
        run_with(stub, fenced("c", "int main(void) { return 0; }", sums))
    assert info.value.reason == "toolchain_missing"
