"""``stream-reward gateway``: its URL is the first line on stdout, it scores through its
own private server and workers, and a SIGTERM stops it cleanly (workers and server gone,
no traceback); with ``--redis`` it starts no workers."""

from __future__ import annotations

import asyncio
import json
import select
import signal
import subprocess
import sys
import time
from pathlib import Path

from gateway_support import ECHO, get, post
from helpers import session_processes

ROOT = Path(__file__).resolve().parents[2]


def start_gateway(*args: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "stream_reward.cli", "gateway", "--port", "0", *args],
        cwd=ROOT,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def first_line(proc: subprocess.Popen[str], limit_s: float = 60) -> str:
    assert proc.stdout is not None
    ready, _, _ = select.select([proc.stdout], [], [], limit_s)
    assert ready, "the gateway printed no URL"
    return proc.stdout.readline().strip()


def stop(proc: subprocess.Popen[str]) -> tuple[int, str, str]:
    proc.send_signal(signal.SIGTERM)
    out, err = proc.communicate(timeout=40)
    return proc.returncode, out, err


def test_prints_its_url_first_scores_and_stops_cleanly_on_sigterm(namespace) -> None:
    proc = start_gateway("--processes", "1", "--scorer", ECHO, "--data-source", "s", "--namespace", namespace)
    try:
        url = first_line(proc)
        assert url.startswith("http://127.0.0.1:")
        status, reply = asyncio.run(post(f"{url}/slime", {"prompt": "q", "response": "4", "label": "4"}))
        assert status == 200 and reply["score"] == 1.0
        # SandboxFusion's route on the same gateway: a program run on this host's sandbox.
        ran = {"code": "print(int(input()) * 2)", "language": "python", "stdin": "21"}
        status, reply = asyncio.run(post(f"{url}/run_code", ran))
        assert status == 200 and reply["status"] == "Success", reply
        assert reply["run_result"]["stdout"] == "42\n"
    finally:
        code, out, err = stop(proc)
    assert code == 143 and "Traceback" not in err, err
    assert out == ""  # nothing after the URL
    deadline = time.monotonic() + 10
    while session_processes(proc.pid) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert session_processes(proc.pid) == []  # its workers and private server went with it


def test_with_redis_it_starts_no_workers(redis_url, namespace) -> None:
    proc = start_gateway("--redis", redis_url, "--namespace", namespace)
    try:
        url = first_line(proc)
        status, text = asyncio.run(get(f"{url}/healthz"))
    finally:
        code, _, err = stop(proc)
    assert status == 503 and "no worker heartbeat" in json.loads(text)["reason"]
    assert code == 143 and "Traceback" not in err, err


def test_a_bad_extra_logs_flag_is_one_line_before_anything_starts(namespace) -> None:
    proc = start_gateway("--processes", "1", "--extra-logs", "acc,,x y", "--namespace", namespace)
    out, err = proc.communicate(timeout=60)
    assert proc.returncode == 2 and out == ""
    assert len(err.strip().splitlines()) == 1 and "--extra-logs" in err and "Traceback" not in err, err
