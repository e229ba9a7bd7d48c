"""The worker's command line: its flags resolve onto the configs (file < environment < flag),
a supervisor's child gets them as given (its own port and one process, never the
environment's password), and the worker program stops well in every state: a SIGTERM
drains within ``--drain-timeout-s`` even with Redis gone, a saturated worker notices it at
once, and a stop between its signal handlers (kept through the imports, then its own)
exits 0 quietly as a stop before the start does.
"""

from __future__ import annotations

import argparse
import asyncio
import signal
import subprocess
from pathlib import Path

import pytest
from helpers import (
    pending_samples,
    run_in_own_session,
    sleepy_batch,
    timed_wait,
    wait_until,
    worker_program_argv,
)

from stream_reward import ProducerConfig, RolloutProducer
from stream_reward.errors import ConfigError
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.ops.worker_cli import FLAG_KEYS, add_worker_arguments, resolve_args, worker_argv

pytestmark = pytest.mark.anyio

ROOT = Path(__file__).resolve().parents[2]
SECRET = "hunter2-s3cret"
SLOW = "python:tests/data/failwell_scorers.py:slow"


def worker_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    return parser


# ---------------------------------------------------------------------- flags
@pytest.mark.usefixtures("clean_env")
def test_worker_flags_resolve_onto_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    parser = worker_parser()
    config = tmp_path / "sr.toml"
    config.write_text("[worker]\nprocesses = 3\nmetrics_port = 9100\n[reward]\ntimeout = 4.0\n")
    monkeypatch.setenv("STREAM_REWARD_CONNECTION_REDIS", f"redis://:{SECRET}@localhost:6379/0")
    args = parser.parse_args(
        [
            "--config",
            str(config),
            "--concurrency",
            "8",
            "--max-concurrent",
            "4",
            "--manager-kwargs",
            '{"max_resp_len": 2048, "batch_size": 16}',
        ]
    )
    settings = resolve_args(args)
    assert resolve_args(args) is settings  # idempotent
    assert (args.processes, args.concurrency, args.timeout_s, args.metrics_port) == (3, 8, 4.0, 9100)
    manager = settings.manager_config()
    assert (manager.max_concurrent, manager.max_resp_len, manager.batch_size, manager.timeout) == (4, 2048, 16, 4.0)
    assert settings.consumer_config().concurrency == 8
    assert set(FLAG_KEYS.values()) <= {f"{sec}.{k}" for sec, keys in settings.values.items() for k in keys}

    argv = worker_argv(args, consumer="host-1-2", slot=2)
    # A child gets the flags as given (plus its own port and one process), the file, not the environment's password.
    assert SECRET not in " ".join(argv)
    assert argv[argv.index("--config") + 1] == str(config)
    assert argv[argv.index("--processes") + 1] == "1"
    assert argv[argv.index("--metrics-port") + 1] == "9102"
    assert argv[argv.index("--consumer") + 1] == "host-1-2"
    assert "--timeout-s" not in argv  # from the file: the child reads it there
    argv = worker_argv(args, consumer="worker-a", slot=1)  # a supervisor that passes the slot
    assert argv[argv.index("--metrics-port") + 1] == "9101" and "--slot" not in argv


@pytest.mark.usefixtures("clean_env")
def test_unknown_manager_kwarg_is_a_config_error() -> None:
    parser = worker_parser()
    with pytest.raises(ConfigError) as err:
        resolve_args(parser.parse_args(["--manager-kwargs", '{"max_rmp": 5}']))
    assert err.value.key == "max_rmp"


# ---------------------------------------------------------------------- shutdown, bounded in every state
async def test_sigterm_with_redis_down_exits_within_the_drain_timeout(namespace):
    with EmbeddedServer() as server:
        url = server.url
        proc = subprocess.Popen(
            worker_program_argv(url, namespace, "--scorer", SLOW, "--drain-timeout-s", "2", "--concurrency", "10"),
            cwd=ROOT,
        )
        try:
            async with RolloutProducer(url, ProducerConfig(namespace=namespace)) as producer:
                await producer.open_batch("down", 4, 4)
                await producer.push_many(sleepy_batch("down", 4, 1.0))

                async def in_flight() -> bool:
                    return await pending_samples(url, namespace) == 4

                await wait_until(in_flight, timeout_s=20)
            server.kill()  # the samples finish with nowhere to write their results
            proc.send_signal(signal.SIGTERM)
            code, waited = timed_wait(proc, 20)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert code is not None, "worker still running 20 s after SIGTERM with Redis down"
    # Drain 2 s plus the exit, with slack for a loaded machine: not the 20 s above.
    assert waited < 2 + 8, waited


async def test_saturated_worker_notices_sigterm_at_once(redis_url, namespace, spawn_workers):
    (proc,) = spawn_workers(1, "--scorer", SLOW, "--drain-timeout-s", "1", "--concurrency", "2")
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer:
        await producer.open_batch("full", 4, 4)
        await producer.push_many(sleepy_batch("full", 4, 20.0))

        async def saturated() -> bool:
            # Two in flight, two waiting for room (the four share an entry, delivered whole).
            return await pending_samples(redis_url, namespace) == 4

        await wait_until(saturated, timeout_s=20)
        await asyncio.sleep(0.3)
    proc.send_signal(signal.SIGTERM)
    code, waited = timed_wait(proc, 30)
    # Drain 1 s plus the exit, with slack for a loaded machine: not the 20 s a slot takes to free.
    assert code == 0 and waited < 1 + 8, (code, waited)


# ---------------------------------------------------------------------- a stop between the kept signals and the worker's handlers
# argv: <module> <SIGTERM|SIGINT> <worker args...>: as ``python -m workers``, with the
# signal sent the first time <module> is looked up by an import.
WORKER_LAUNCH = r"""
import os, signal, sys

MOD, SIG = sys.argv[1], getattr(signal, sys.argv[2])
del sys.argv[1:3]
from stream_reward.ops import early_signals

early_signals.keep()
state = {"fired": False}


class Hook:
    def find_spec(self, name, path=None, target=None):
        if not state["fired"] and name == MOD:
            state["fired"] = True
            os.kill(os.getpid(), SIG)
        return None


sys.meta_path.insert(0, Hook())
from stream_reward.worker.main import main

sys.exit(main(sys.argv[1:]))
"""


@pytest.mark.parametrize("sig", ["SIGTERM", "SIGINT"])
@pytest.mark.parametrize(
    ("module", "processes"),
    [("stream_reward.worker.consumer", "1"), ("stream_reward.worker.supervisor", "2")],
    ids=["worker-imports-consumer", "pool-imports-supervisor-before-join"],
)
def test_worker_or_pool_stopped_between_its_handlers_exits_0_quietly(redis_url, namespace, sig, module, processes):
    """After ``stream_reward.worker.main.main`` gave back the signals kept through its imports
    and before ``run_worker`` installs its loop handlers (argparse, ``resolve_args``,
    ``asyncio.run``'s set-up, the import of the consumer), a SIGTERM would meet SIG_DFL (a
    death by signal, -15, nothing drained) and a Ctrl-C asyncio.Runner's handler (a
    KeyboardInterrupt traceback, -2). Likewise a pool before ``_join_unless_stopped`` puts
    its handlers in (its import of the supervisor)."""
    rc, took, err, left = run_in_own_session(
        WORKER_LAUNCH,
        [module, sig, "--redis", redis_url, "--namespace", namespace, "--processes", processes],
        limit_s=30,
    )
    assert rc == 0, (rc, took, err[-3000:], left)
    assert "Traceback" not in err, err[-3000:]
    assert not left, left
