"""``POST /run_code``, SandboxFusion's endpoint on our sandbox: a real aiohttp app on
loopback with only this route, running real programs in real sandboxes.

Pinned: SandboxFusion's reply shapes (Success / Failed with the program's return code
and output / TimeLimitExceeded), the request's limits honoured and clamped to ours,
output capped, a language we cannot run refused as SandboxFusion refuses one, malformed
requests refused with one line and nothing run, files written before a run
and fetched after it (inside the program's own directory only), our own faults answered SandboxError
(never Success or Failed), the concurrency bound held, and our own SandboxFusion
client scoring every test form through the endpoint.
"""

from __future__ import annotations

import asyncio
import base64
import json
import os
import shutil
import time
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

import aiohttp
import pytest
from aiohttp import web
from aiohttp.test_utils import TestServer

from stream_reward.config import SandboxConfig
from stream_reward.errors import ConfigError
from stream_reward.gateway.run_code import RunCodeConfig, add_run_code_routes
from stream_reward.scoring.sandbox.fusion import SandboxFusionConfig, SandboxFusionScorer
from stream_reward.scoring.sandbox.scorer import SandboxScorer
from stream_reward.wire.trajectory import Trajectory

# A uid range of our own, apart from other test modules' sandboxes on this host.
UIDS = dict(uid_base=400_000 + (os.getpid() % 10_000) * 16, uid_count=16)
LIMITS = dict(concurrency=2, max_run_timeout_s=3.0, max_memory_mb=512, max_output_bytes=64 * 1024)

Post = Callable[..., Awaitable[tuple[int, dict[str, Any]]]]


@pytest.fixture(scope="module", autouse=True)
def sandbox_backend() -> None:
    """Skipped, as the sandbox's own tests are, on a host where no backend runs
    (scripts/setup.sh installs bubblewrap)."""
    try:
        SandboxScorer(SandboxConfig(**UIDS)).close()
    except ConfigError as exc:
        pytest.skip(f"sandbox backend unavailable here: {exc}")


def serve(test: Callable[[Post, str], Awaitable[Any]], **overrides: Any) -> Any:
    """Runs ``test(post, base_url)`` against an app with only ``/run_code``;
    ``post(body, raw=None)`` answers ``(http status, JSON reply)``."""
    sandbox = SandboxConfig(**{**UIDS, **overrides.pop("sandbox", {})})
    config = RunCodeConfig(**{**LIMITS, **overrides, "sandbox": sandbox})

    async def go() -> Any:
        app = web.Application()
        add_run_code_routes(app, config)
        async with TestServer(app, host="127.0.0.1") as server, aiohttp.ClientSession() as session:
            url = str(server.make_url("/run_code"))

            async def post(body: Any, raw: bytes | None = None) -> tuple[int, dict[str, Any]]:
                data = raw if raw is not None else json.dumps(body).encode()
                async with session.post(url, data=data, headers={"Content-Type": "application/json"}) as resp:
                    return resp.status, await resp.json()

            return await test(post, str(server.make_url("")))

    return asyncio.run(go())


def call(body: dict[str, Any], **overrides: Any) -> tuple[int, dict[str, Any]]:
    async def one(post: Post, _url: str) -> tuple[int, dict[str, Any]]:
        return await post(body)

    return serve(one, **overrides)


def python(code: str, **fields: Any) -> dict[str, Any]:
    return {"code": code, "language": "python", **fields}


def test_stdin_is_read_and_stdout_returned_as_success():
    status, reply = call(python("import sys\nprint(sys.stdin.read().upper(), end='')", stdin="hello\nworld\n"))
    assert status == 200
    assert reply["status"] == "Success" and reply["message"] == ""
    assert reply["compile_result"] is None and reply["files"] == {} and "executor_pod_name" in reply
    run = reply["run_result"]
    assert run["status"] == "Finished" and run["return_code"] == 0
    assert run["stdout"] == "HELLO\nWORLD\n" and run["stderr"] == ""
    assert 0 <= run["execution_time"] < 3.0


def test_nonzero_exit_is_failed_with_its_return_code_and_stderr():
    status, reply = call(python("import sys\nprint('partial')\nprint('boom', file=sys.stderr)\nsys.exit(4)"))
    assert status == 200 and reply["status"] == "Failed"
    run = reply["run_result"]
    assert (run["status"], run["return_code"], run["stdout"], run["stderr"]) == ("Finished", 4, "partial\n", "boom\n")


def test_uncaught_exception_is_failed_with_its_traceback():
    _, reply = call(python("raise ValueError('nope')"))
    assert reply["status"] == "Failed" and reply["run_result"]["return_code"] == 1
    assert "ValueError: nope" in reply["run_result"]["stderr"]


def test_program_past_run_timeout_is_time_limit_exceeded():
    for code in ("while True:\n    pass", "import time\ntime.sleep(1000)"):
        start = time.monotonic()
        _, reply = call(python(code, run_timeout=1))
        assert reply["status"] == "Failed", code
        assert reply["run_result"]["status"] == "TimeLimitExceeded" and reply["run_result"]["return_code"] is None
        assert time.monotonic() - start < 30  # generous: a loaded machine, plus the app's start


def test_run_timeout_is_clamped_to_the_configured_maximum():
    start = time.monotonic()
    _, reply = call(python("import time\ntime.sleep(1000)", run_timeout=10_000), max_run_timeout_s=1.0)
    assert reply["run_result"]["status"] == "TimeLimitExceeded"
    assert time.monotonic() - start < 30


def test_memory_over_the_request_limit_fails_with_memory_error():
    code = "x = bytearray(300 << 20)\nprint('allocated')"
    _, small = call(python(code, memory_limit_MB=128))
    assert small["status"] == "Failed" and small["run_result"]["stdout"] == ""
    assert "MemoryError" in small["run_result"]["stderr"]
    _, enough = call(python(code, memory_limit_MB=512))
    assert enough["status"] == "Success" and enough["run_result"]["stdout"] == "allocated\n"


def test_memory_limit_is_clamped_to_the_configured_maximum():
    # -1 is SandboxFusion's "no limit"; neither it nor a huge number lifts ours (512 MB).
    for limit in (-1, 1_000_000):
        _, reply = call(python("x = bytearray(800 << 20)\nprint('allocated')", memory_limit_MB=limit))
        assert reply["status"] == "Failed" and "allocated" not in reply["run_result"]["stdout"], limit


def test_output_over_the_cap_is_cut_and_failed():
    _, reply = call(python("import sys\nwhile True:\n    sys.stdout.write('x' * 4096)"))
    assert reply["status"] == "Failed" and reply["message"] == "output limit exceeded"
    assert reply["run_result"]["return_code"] == -9
    assert len(reply["run_result"]["stdout"]) <= LIMITS["max_output_bytes"]


@pytest.mark.parametrize("language", ["cpp", "java", "python3", "cobol", ""])
def test_language_the_sandbox_cannot_run_is_refused_like_sandbox_fusion(language):
    status, reply = call({"code": "print(1)", "language": language})
    assert status == 422
    (detail,) = reply["detail"]
    assert detail["type"] == "literal_error" and detail["loc"] == ["body", "language"]
    assert detail["input"] == language and "'python'" in detail["msg"]
    assert "\n" not in reply["error"] and "language" in reply["error"]


@pytest.mark.parametrize(
    "body, field",
    [
        ([], ""),
        ("print(1)", ""),
        ({"language": "python"}, "code"),
        ({"code": ["print(1)"], "language": "python"}, "code"),
        ({"code": "print(1)"}, "language"),
        (python("print(1)", stdin=5), "stdin"),
        (python("print(1)", run_timeout="10"), "run_timeout"),
        (python("print(1)", run_timeout=0), "run_timeout"),
        (python("print(1)", run_timeout=True), "run_timeout"),
        (python("print(1)", compile_timeout=None), "compile_timeout"),
        (python("print(1)", memory_limit_MB=1.5), "memory_limit_MB"),
        (python("print(1)", files=["a.txt"]), "files"),
        (python("print(1)", files={"a.txt": "not base64!"}), "files"),
        (python("print(1)", files={"a.txt": 5}), "files"),
        (python("print(1)", files={"big.bin": base64.b64encode(bytes(5000)).decode()}), "files"),
        (python("print(1)", fetch_files="out.txt"), "fetch_files"),
        (python("print(1)", fetch_files=[1]), "fetch_files"),
    ],
)
def test_malformed_request_is_refused_with_a_one_line_reason(body, field):
    status, reply = call(body, max_files_bytes=4096)
    assert status == 422
    assert reply["detail"][0]["loc"] == ["body", field]
    assert reply["error"] and "\n" not in reply["error"]


def test_unreadable_or_oversize_body_is_refused_before_anything_runs():
    async def test(post: Post, _url: str) -> list[tuple[int, dict[str, Any]]]:
        return [
            await post(None, raw=b'{"code": "print(1)", "language": '),
            await post(None, raw=b"\xff\xfe"),
            await post(python("#" * 9000)),
            # Past the JSON parser's own limits (its recursion, its integer digits).
            await post(
                None, raw=b'{"code": "print(1)", "language": "python", "files": ' + b"[" * 3000 + b"]" * 3000 + b"}"
            ),
            await post(None, raw=b'{"code": "print(1)", "language": "python", "run_timeout": ' + b"9" * 4400 + b"}"),
        ]

    (bad, binary, big, deep, digits) = serve(test, max_body_bytes=8192)
    assert bad[0] == 400 and "not JSON" in bad[1]["error"]
    assert binary[0] == 400
    assert deep[0] == 400 and "not JSON" in deep[1]["error"]
    assert digits[0] == 400 and "not JSON" in digits[1]["error"]
    assert big[0] == 413 and "8192" in big[1]["error"]


def test_request_fields_that_are_optional_in_sandbox_fusion_take_its_defaults():
    status, reply = call(python("print(input())", stdin=None, files={"ignored.txt": None}, fetch_files=[], extra=1))
    # stdin null is no input: input() meets EOF, the program's own failure
    assert status == 200 and reply["status"] == "Failed" and "EOFError" in reply["run_result"]["stderr"]


def b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


def test_files_are_written_before_the_run_and_fetched_after_it():
    code = (
        "import os\n"
        "print(open('data/in.txt').read())\n"
        "open('out.txt', 'w').write('result')\n"
        "os.mkfifo('pipe')\n"
        "raise SystemExit(3)\n"
    )
    fetch = ["out.txt", "data/in.txt", "missing.txt", "pipe", "data"]
    _, reply = call(python(code, files={"data/in.txt": b64(b"given")}, fetch_files=fetch))
    assert reply["status"] == "Failed" and reply["run_result"]["return_code"] == 3
    assert reply["run_result"]["stdout"] == "given\n"
    # regular files only: not a missing one, a FIFO (which must not hang the run) or a directory
    assert reply["files"] == {"out.txt": b64(b"result"), "data/in.txt": b64(b"given")}


def test_files_do_not_outlive_their_run():
    async def test(post: Post, _url: str) -> list[dict[str, Any]]:
        first = await post(python("open('left.txt', 'w').write('x')", fetch_files=["left.txt"]))
        second = await post(python("import os\nprint(os.path.exists('left.txt'))", fetch_files=["left.txt"]))
        return [first[1], second[1]]

    first, second = serve(test, concurrency=1)  # one slot: the same sandbox serves both
    assert first["files"] == {"left.txt": b64(b"x")}
    assert second["run_result"]["stdout"] == "False\n" and second["files"] == {}


@pytest.mark.parametrize("name", ["../escape.txt", "/etc/passwd", "a/../../b", "./a", "a//b", "", "a/"])
def test_file_paths_outside_the_program_directory_are_refused(name):
    for body in (python("print(1)", files={name: b64(b"x")}), python("print(1)", fetch_files=[name])):
        status, reply = call(body)
        assert status == 422 and reply["detail"][0]["type"] == "path", body


def test_sandbox_that_cannot_start_is_sandbox_error(tmp_path: Path):
    # bwrap through a wrapper that starts failing once the flag exists: the backend
    # probe at startup passes, the request's sandbox cannot start.
    real = shutil.which("bwrap")
    if real is None:
        pytest.skip("bwrap is not installed")
    flag, wrapper = tmp_path / "broken", tmp_path / "bwrap"
    wrapper.write_text(
        f"#!/bin/sh\nif [ -e {flag} ]; then echo 'bwrap: simulated failure' >&2; exit 1; fi\nexec {real} \"$@\"\n"
    )
    wrapper.chmod(0o755)

    async def test(post: Post, _url: str) -> list[dict[str, Any]]:
        flag.touch()
        replies = [(await post(python("print('ok')")))[1] for _ in range(2)]
        flag.unlink()
        replies.append((await post(python("print('ok')")))[1])  # and it recovers
        return replies

    first, second, recovered = serve(test, sandbox=dict(backend="bwrap", bwrap_path=str(wrapper)))
    for reply in (first, second):
        assert reply["status"] == "SandboxError" and reply["run_result"] is None
        assert "simulated failure" in reply["message"]
    assert recovered["status"] == "Success"


def test_host_without_a_sandbox_answers_sandbox_error_not_a_result(tmp_path: Path):
    status, reply = call(python("print('ok')"), sandbox=dict(backend="bwrap", bwrap_path=str(tmp_path / "missing")))
    assert status == 200 and reply["status"] == "SandboxError" and reply["run_result"] is None
    assert "unavailable" in reply["message"]


def test_concurrency_bound_is_held():
    # Each program reports when it ran; with 2 slots no 3 of 6 runs overlap.
    code = "import time\nstart = time.time()\ntime.sleep(0.5)\nprint(start, time.time())"

    async def test(post: Post, _url: str) -> list[tuple[int, dict[str, Any]]]:
        return await asyncio.gather(*(post(python(code)) for _ in range(6)))

    replies = serve(test)
    spans = []
    for status, reply in replies:
        assert status == 200 and reply["status"] == "Success"
        start, end = map(float, reply["run_result"]["stdout"].split())
        spans.append((start, end))
    for start, _ in spans:
        running = sum(1 for s, e in spans if s <= start < e)
        assert running <= LIMITS["concurrency"], spans


def test_sandbox_fusion_client_scores_every_form_through_run_code():
    cases = [
        ("print(int(input()) * 2)", {"inputs": ["2\n", "5\n"], "outputs": ["4\n", "10\n"]}, 1.0),
        ("print(int(input()) + 2)", {"inputs": ["2\n", "5\n"], "outputs": ["4\n", "10\n"]}, 0.5),
        ("def add(a, b):\n    return a + b", {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}, 1.0),
        ("def add(a, b):\n    return a - b", {"fn_name": "add", "inputs": [[1, 2]], "outputs": [3]}, 0.0),
        ("def sq(x):\n    return x * x", {"assert_case": ["assert sq(3) == 9", "assert sq(2) == 5"]}, 0.5),
        ("def inc(x):\n    return x + 1", {"test": "def check(c):\n    assert c(1) == 2", "entry_point": "inc"}, 1.0),
        ("while True:\n    pass", {"inputs": [""], "outputs": ["1"]}, 0.0),
    ]

    async def test(_post: Post, url: str) -> list[float]:
        config = SandboxFusionConfig(run_timeout_s=1.0, retries=0)
        async with SandboxFusionScorer(url, config) as scorer:
            return [
                (
                    await scorer.score(
                        Trajectory(
                            batch_id="b",
                            index=i,
                            data_source="code",
                            response=f"```python\n{code}\n```",
                            ground_truth=json.dumps(gt),
                        )
                    )
                ).score
                for i, (code, gt, _) in enumerate(cases)
            ]

    assert serve(test) == [expected for _, _, expected in cases]


def test_bodies_held_waiting_for_a_slot_are_bounded_over_it_a_retryable_504():
    """More requests than slots wait their turn, each holding its body (up to
    max_body_bytes): past max_queued_bytes held at once, a request is refused at once
    with a 504, the status SandboxFusion clients retry (verl retries only a 504), not
    queued until the gateway runs out of memory."""
    code = "#" + "x" * 20_000 + "\nimport time\ntime.sleep(2)\nprint('done')"

    async def test(post: Post, _url: str) -> list[tuple[int, dict[str, Any]]]:
        return await asyncio.gather(*(post(python(code)) for _ in range(6)))

    replies = serve(test, max_body_bytes=32_000, max_queued_bytes=64_000)
    refused = [reply for status, reply in replies if status == 504]
    ran = [reply for status, reply in replies if status == 200]
    assert len(refused) + len(ran) == 6 and refused and len(ran) >= 2
    assert all(r["status"] == "Success" and r["run_result"]["stdout"] == "done\n" for r in ran)
    assert all("64000" in r["error"] and "\n" not in r["error"] for r in refused)
