"""The ``stream-reward`` command: each subcommand parses, resolves its settings and calls
the library. An expected fault (Redis unreachable, a wrong password, a missing file, bad
JSON or config, a bad flag) is one line on stderr and exit 2, within seconds; ``--debug``
shows the traceback. A deprecated flag or environment name is one line of ours naming the
new one. ``worker`` becomes the worker program (exec); ``produce`` and ``collect`` take
their connection from the config. (A signal at any moment: ``test_cli_signals.py``.)
"""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import pytest
from helpers import GOOD, one_line, read_err, stream_reward_cli, timed_wait, worker_program_argv

from stream_reward import ProducerConfig, RolloutProducer, Trajectory
from stream_reward.cli import main
from stream_reward.cli import main as cli_main
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.trainer.aggregator import RewardAggregator

pytestmark = pytest.mark.usefixtures("clean_env", "restore_logging")

ROOT = Path(__file__).resolve().parents[2]


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("demo", "server", "worker", "produce", "collect", "score", "status", "config", "bench"):
        assert command in out


def test_worker_without_redis_anywhere_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--burst"]) == 2
    assert "connection.redis" in capsys.readouterr().err
    assert main(["status"]) == 2
    assert "connection.redis" in capsys.readouterr().err


def test_worker_command_becomes_the_worker_program(redis_url: str, namespace: str) -> None:
    """`stream-reward worker` execs `python -m workers` in its own process: it scores, and exits 0 in burst mode."""

    async def push() -> None:
        async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
            await producer.open_batch("exec", 2, 8)
            for i, answer in enumerate(["#### 4", "#### 5"]):
                await producer.push(
                    Trajectory("exec", i, "openai/gsm8k", response=answer, ground_truth="4", valid_response_length=3)
                )

    async def collect() -> list[float]:
        async with RewardAggregator(redis_url, namespace=namespace) as agg:
            return (await agg.collect("exec", timeout_s=30)).scores

    asyncio.run(push())
    argv = [sys.executable, "-m", "stream_reward.cli", "worker", "--redis", redis_url, "--namespace", namespace]
    proc = subprocess.run([*argv, "--burst"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr
    assert asyncio.run(collect()) == [1.0, 0.0]


# ---------------------------------------------------------------------- one clear line, timeouts honoured
def test_expected_faults_are_one_line_exit_2_and_debug_shows_the_traceback(tmp_path):
    nowhere = f"unix://{tmp_path}/nothing.sock"
    bad_json = tmp_path / "bad.json"
    bad_json.write_text("{not json")
    cases = [
        ["status", "--redis", nowhere],
        ["dlq", "list", "--redis", nowhere],
        ["score", str(tmp_path)],  # a directory
        ["score", str(tmp_path / "missing.jsonl")],
        ["status", "--redis", nowhere, "--config", str(bad_json)],
        ["status", "--no-such-flag"],
    ]
    for args in cases:
        done, took = stream_reward_cli(*args, timeout_s=90)
        assert done.returncode == 2, (args, done.returncode, done.stderr)
        one_line(done.stderr)
        # The CLI's start-up (up to ~11 s beside two CPU hogs), and no retrying (30 s, GIVE_UP_S).
        assert took < 30, (args, took)
    done, _ = stream_reward_cli("--debug", "status", "--redis", nowhere, timeout_s=60)
    assert done.returncode != 0 and "Traceback" in done.stderr


def test_wrong_password_is_permanent_one_line_and_fast(namespace):
    secret = "s3cret-pw-123"
    with EmbeddedServer(extra_args=["--requirepass", secret]) as server:
        bad = f"unix://:wrong-{secret}@{server.socket_path}"
        proc = subprocess.Popen(worker_program_argv(bad, namespace), cwd=ROOT, stderr=subprocess.PIPE)
        # The bounds include the process's start-up (its imports: up to ~11 s beside two CPU
        # hogs); an error taken for a transient one is retried for 60 s.
        code, waited = timed_wait(proc, 60)
        stderr = read_err(proc)
        assert code == 2 and waited < 30, (code, waited, stderr)
        line = one_line(stderr)
        assert "auth" in line.lower() and secret not in line and "unreachable" not in line, line
        for args in (["status"], ["dlq", "list"]):
            done, took = stream_reward_cli(*args, "--redis", bad, timeout_s=60)
            assert done.returncode == 2 and took < 30, (args, done.returncode, took, done.stderr)
            line = one_line(done.stderr)
            assert "auth" in line.lower() and secret not in line, line


def test_collect_timeout_is_honoured_when_nothing_listens(tmp_path):
    # Without --timeout-s the collect waits for ever: the call would raise TimeoutExpired at 120 s.
    done, took = stream_reward_cli(
        "collect", "--redis", f"unix://{tmp_path}/nothing.sock", "--batch", "b", "--timeout-s", "3", timeout_s=120
    )
    # 3 s, not the default wait. The wall clock here includes the CLI's start-up (its imports),
    # which took 5 s in CI's parallel suite and 11 s beside two CPU hogs: a generous bound,
    # still far from the default, and the message names the 3 s.
    assert done.returncode == 2 and took < 3 + 45, (done.returncode, took, done.stderr)
    assert "within the 3s timeout" in done.stderr, done.stderr
    assert "Traceback" not in done.stderr and "timeout" in done.stderr.splitlines()[-1], done.stderr


def test_oversized_line_fails_alone_with_its_line_number_and_the_setting(tmp_path):
    ok = json.dumps({"data_source": "openai/gsm8k", "response": "#### 1", "ground_truth": "1"})
    huge = json.dumps({"data_source": "openai/gsm8k", "response": "x" * 20_000, "ground_truth": "1"})
    src = tmp_path / "in.jsonl"
    src.write_text(f"{ok}\n{huge}\n{ok}\n\n")  # and a trailing blank line
    out = tmp_path / "out.jsonl"
    env = {**os.environ, "STREAM_REWARD_CONSUMER_MAX_MESSAGE_BYTES": "10000"}
    done, _ = stream_reward_cli("score", str(src), "--out", str(out), "--processes", "1", "--timeout-s", "60", env=env)
    assert done.returncode == 0, done.stderr
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert [r["status"] for r in rows] == ["ok", "failed", "ok"], rows  # no phantom row for the blank line
    assert "line 2" in rows[1]["error"] and "max_message_bytes" in rows[1]["error"], rows[1]


# ---------------------------------------------------------------------- end to end
def test_produce_and_collect_with_connection_from_the_config(
    redis_url: str, namespace: str, spawn_workers: Any, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "sr.toml"
    config.write_text(
        f'[connection]\nredis = "{redis_url}"\nnamespace = "{namespace}"\n[policy]\non_failure = "drop"\n'
    )
    rollouts = tmp_path / "rollouts.jsonl"
    good = json.dumps(
        {"data_source": "openai/gsm8k", "response": GOOD, "ground_truth": "6", "valid_response_length": 8}
    )
    rollouts.write_text(f"{good}\nnot json\n{good}\n")
    assert main(["produce", "--config", str(config), "--batch", "p1", str(rollouts)]) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"batch": "p1", "pushed": 2, "bad_lines": 1}
    spawn_workers(1)
    assert main(["collect", "--config", str(config), "--batch", "p1", "--timeout-s", "30", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    # The config's failure policy (drop) reached the batch: the bad line's row is gone.
    assert out["indices"] == [0, 2] and out["status"] == ["ok", "ok"] and out["scores"] == [1.0, 1.0]


# ---------------------------------------------------------------------- deprecations
def test_an_old_flag_is_one_line_of_ours_not_pythons_warning(capsys: pytest.CaptureFixture[str]) -> None:
    """Python's line names our file and line (``.../worker_cli.py:90: ConfigDeprecationWarning:``)
    and prints the source line under it; the user needs the new spelling only."""
    assert main(["score", "/nonexistent/in.jsonl", "--timeout", "5"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        "stream-reward score: --timeout is deprecated; use --timeout-s",
        "stream-reward score: /nonexistent/in.jsonl: No such file or directory",
    ]


def test_old_flags_and_environment_names_are_one_line_each_from_the_programs() -> None:
    """As run, with Python's own warning filters: the CLI, and the worker program that
    ``stream-reward worker`` becomes (it says its own, the CLI says nothing before the exec)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), "STREAM_REWARD_MAX_RPM": "5"}
    env.pop("PYTHONWARNINGS", None)
    nowhere = ["--redis", "unix:///nonexistent/redis.sock"]
    runs = {
        "config": [sys.executable, "-m", "stream_reward.cli", "config", "show", "--json", "--max-inflight", "4"],
        "worker": [sys.executable, "-m", "stream_reward.worker", *nowhere, "--max-inflight", "4", "--check"],
        "cli worker": [sys.executable, "-m", "stream_reward.cli", "worker", *nowhere, "--max-inflight", "4", "--check"],
    }
    for name, argv in runs.items():
        proc = subprocess.run(argv, cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
        prog = "stream-reward config" if name == "config" else "stream-reward worker"
        said = [line for line in proc.stderr.splitlines() if "deprecated" in line]
        assert said == [
            f"{prog}: --max-inflight is deprecated; use --max-concurrent",
            f"{prog}: $STREAM_REWARD_MAX_RPM is deprecated; set $STREAM_REWARD_QUOTA_MAX_RPM instead",
        ], (name, proc.stderr)
        assert "Warning" not in proc.stderr, (name, proc.stderr)


def test_stream_reward_worker_leaves_its_deprecations_to_the_worker_program_it_becomes(tmp_path: Path) -> None:
    """``stream-reward worker`` parses the flags, then execs the worker program, which parses
    them again: the line is said once, by the program that runs."""
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    argv = [sys.executable, "-m", "stream_reward.cli", "worker", "--redis", f"unix://{tmp_path}/nothing.sock"]
    proc = subprocess.Popen(
        [*argv, "--max-inflight", "4"], cwd=ROOT, env=env, stdin=subprocess.DEVNULL, stderr=subprocess.PIPE
    )
    guard = threading.Timer(60, proc.kill)  # a worker that never says "retrying" ends the read
    guard.start()
    try:
        assert proc.stderr is not None
        seen = []
        for raw in proc.stderr:  # up to its first retry of the absent server: past the exec
            seen.append(raw.decode(errors="replace"))
            if "retrying" in seen[-1]:
                break
    finally:
        guard.cancel()
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert "retrying" in "".join(seen), seen
    said = [line.strip() for line in seen if "deprecated" in line]
    assert said == ["stream-reward worker: --max-inflight is deprecated; use --max-concurrent"], seen


def test_cli_produce_of_an_existing_batch_exits_2_with_a_hint(
    redis_url: str, namespace: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    rollouts = tmp_path / "r.jsonl"
    rollouts.write_text(json.dumps({"data_source": "test", "response": "a", "ground_truth": "a"}) + "\n")
    argv = ["produce", "--redis", redis_url, "--namespace", namespace, "--batch", "step-1", str(rollouts)]
    assert cli_main(argv) == 0
    capsys.readouterr()
    assert cli_main(argv) == 2
    err = capsys.readouterr().err
    assert "already" in err and "step-1" in err and "unique batch id" in err
    assert "Traceback" not in err


def test_redis_timeout_s_bounds_every_round_trip_of_a_command(
    redis_url: str, namespace: str, capsys: pytest.CaptureFixture[str]
) -> None:
    """``--redis-timeout-s`` (``connection.timeout_s``) is every client's deadline in the
    command, not only ``worker --check``'s: a black-holed server fails ``status`` after it."""
    from helpers import CutProxy

    from stream_reward.wire.connection import DEFAULT_TIMEOUT_S, set_default_timeout

    async def run() -> tuple[int, float]:
        async with CutProxy(redis_url[len("unix://") :]) as proxy:
            proxy.black = True
            loop = asyncio.get_running_loop()
            start = loop.time()
            argv = ["status", "--redis", proxy.url, "--namespace", namespace, "--redis-timeout-s", "0.5"]
            code = await asyncio.to_thread(cli_main, argv)
            return code, loop.time() - start

    try:
        code, took = asyncio.run(run())
    finally:
        set_default_timeout(DEFAULT_TIMEOUT_S)
    err = capsys.readouterr().err
    assert code == 2 and "Redis unreachable (TimeoutError" in err, err
    assert took < 4.0, took  # 0.5 s; the default is 5 s
