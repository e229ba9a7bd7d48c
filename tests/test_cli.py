"""The CLI's configuration, secrets, logging and progress, through ``cli.main([...])``."""

from __future__ import annotations

import io
import json
import logging
import sys
from pathlib import Path

import pytest

from stream_reward.cli import main
from stream_reward.errors import ConfigDeprecationWarning, ConfigError
from stream_reward.ops.logs import JsonFormatter, configure_logging, progress_bar
from stream_reward.ops.settings import env_name, load_settings, mask_secrets, schema

SECRET = "hunter2-s3cret"


@pytest.fixture(autouse=True)
def _clean_env(clean_env: None) -> None:
    """Every test here reads settings: none may leak in from the outer environment."""


@pytest.fixture(autouse=True)
def restore_logging() -> object:
    root = logging.getLogger()
    handlers, level = list(root.handlers), root.level
    yield
    for handler in list(root.handlers):
        if handler not in handlers:
            root.removeHandler(handler)
    root.setLevel(level)


def show(capsys: pytest.CaptureFixture[str], *argv: str) -> dict:
    assert main(["config", "show", "--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def write(tmp_path: Path, name: str, text: str) -> str:
    path = tmp_path / name
    path.write_text(text)
    return str(path)


# ---------------------------------------------------------------------- precedence
def test_precedence_file_env_flag(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(
        tmp_path,
        "sr.toml",
        """
[connection]
namespace = "file-ns"
[quota]
max_rpm = 10
max_tpm = 1000
[consumer]
concurrency = 7
block_ms = 50
""",
    )
    only_file = show(capsys, "--config", config)
    assert only_file["config"]["connection"]["namespace"] == "file-ns"
    assert only_file["config"]["quota"]["max_rpm"] == 10.0
    assert only_file["sources"]["quota.max_rpm"] == "file"

    monkeypatch.setenv("STREAM_REWARD_QUOTA_MAX_RPM", "20")
    monkeypatch.setenv("STREAM_REWARD_CONNECTION_NAMESPACE", "env-ns")
    monkeypatch.setenv("STREAM_REWARD_CONSUMER_CONCURRENCY", "9")
    with_env = show(capsys, "--config", config)
    assert with_env["config"]["quota"]["max_rpm"] == 20.0
    assert with_env["config"]["connection"]["namespace"] == "env-ns"
    assert with_env["config"]["consumer"]["concurrency"] == 9
    assert with_env["sources"]["quota.max_rpm"] == "env"

    flags = show(capsys, "--config", config, "--max-rpm", "30", "--namespace", "flag-ns", "--block-ms", "5")
    c = flags["config"]
    assert c["quota"]["max_rpm"] == 30.0 and flags["sources"]["quota.max_rpm"] == "flag"
    assert c["connection"]["namespace"] == "flag-ns"
    assert c["consumer"]["block_ms"] == 5
    assert c["consumer"]["concurrency"] == 9  # env, no flag
    assert c["quota"]["max_tpm"] == 1000.0  # file only
    assert c["consumer"]["read_count"] == 256 and "consumer.read_count" not in flags["sources"]  # default


def test_config_file_from_environment_variable(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STREAM_REWARD_CONFIG", write(tmp_path, "sr.yaml", "connection:\n  namespace: yaml-ns\n"))
    out = show(capsys)
    assert out["config"]["connection"]["namespace"] == "yaml-ns"
    assert out["file"].endswith("sr.yaml")


def test_verl_keys_map_onto_manager_and_consumer_config(tmp_path: Path) -> None:
    config = write(
        tmp_path,
        "sr.yaml",
        """
connection:
  redis: redis://localhost:6379/0
  namespace: exp1
  group: judges
  partitions: 2
reward:
  manager: dapo
  scorer: python:my_reward.py:compute_score
  timeout: 12.5
  retries: 3
  reward_kwargs: {format_score: 0.1}
  max_resp_len: 4096
  overlong_buffer_cfg: {enable: true, len: 512, penalty_factor: 1.0, log: true}
quota:
  max_concurrent: 32
  max_rpm: 600
  max_tpm: 200000
  estimated_tokens_per_request: 1500
  quota_key: judge
consumer:
  reclaim_idle_ms: 5000
  heartbeat_interval_s: 1.0
policy:
  on_failure: fallback
  fallback_score: -1
  deadline_s: 300
""",
    )
    s = load_settings(config, env={})
    m = s.manager_config()
    assert (m.manager, m.scorer, m.timeout, m.retries) == ("dapo", "python:my_reward.py:compute_score", 12.5, 3)
    assert m.reward_kwargs == {"format_score": 0.1}
    assert m.overlong_buffer_cfg == {"enable": True, "len": 512, "penalty_factor": 1.0, "log": True}
    assert (m.max_resp_len, m.max_concurrent, m.max_rpm, m.max_tpm) == (4096, 32, 600.0, 200000.0)
    assert (m.estimated_tokens_per_request, m.quota_key, m.redis_url, m.namespace) == (
        1500,
        "judge",
        "redis://localhost:6379/0",
        "exp1",
    )
    c = s.consumer_config(consumer="w1")
    assert (c.namespace, c.group, c.partitions, c.consumer) == ("exp1", "judges", 2, "w1")
    assert (c.reclaim_idle_ms, c.heartbeat_interval_s) == (5000, 1.0)
    p = s.batch_policy()
    assert (p.on_failure, p.fallback_score, p.deadline_s) == ("fallback", -1.0, 300.0)
    assert s.producer_config().partitions == 2


def test_worker_flags_resolve_onto_configs(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    import argparse

    from stream_reward.ops.worker_cli import FLAG_KEYS, add_worker_arguments, resolve_args, worker_argv

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    config = write(tmp_path, "sr.toml", "[worker]\nprocesses = 3\nmetrics_port = 9100\n[reward]\ntimeout = 4.0\n")
    monkeypatch.setenv("STREAM_REWARD_CONNECTION_REDIS", f"redis://:{SECRET}@localhost:6379/0")
    args = parser.parse_args(
        [
            "--config",
            config,
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
    assert argv[argv.index("--config") + 1] == config
    assert argv[argv.index("--processes") + 1] == "1"
    assert argv[argv.index("--metrics-port") + 1] == "9102"
    assert argv[argv.index("--consumer") + 1] == "host-1-2"
    assert "--timeout-s" not in argv  # from the file: the child reads it there
    argv = worker_argv(args, consumer="worker-a", slot=1)  # a supervisor that passes the slot
    assert argv[argv.index("--metrics-port") + 1] == "9101" and "--slot" not in argv


def test_unknown_manager_kwarg_is_a_config_error() -> None:
    import argparse

    from stream_reward.ops.worker_cli import add_worker_arguments, resolve_args

    parser = argparse.ArgumentParser()
    add_worker_arguments(parser)
    with pytest.raises(ConfigError) as err:
        resolve_args(parser.parse_args(["--manager-kwargs", '{"max_rmp": 5}']))
    assert err.value.key == "max_rmp"


# ---------------------------------------------------------------------- invalid config
@pytest.mark.parametrize(
    ("text", "key", "reason"),
    [
        ("[quota]\nmax_rpm = -1\n", "quota.max_rpm", "must be > 0"),
        ("[consumer]\nconcurrency = 0\n", "consumer.concurrency", "must be >= 1"),
        ("[consumer]\nconcurrency = 'many'\n", "consumer.concurrency", "must be an integer"),
        ("[consumer]\nconcurency = 3\n", "consumer.concurency", "unknown key"),
        ("[quotas]\nmax_rpm = 3\n", "quotas", "unknown section"),
        ("[policy]\non_failure = 'ignore'\n", "policy.on_failure", "must be one of"),
        ("[reward]\novershoot = 1\n", "reward.overshoot", "unknown key"),
        (
            "[reward]\nmax_resp_len = 100\noverlong_buffer_cfg = { enable = true, len = 0 }\n",
            "reward.overlong_buffer_cfg.len",
            "> 0",
        ),
        (
            "[reward]\nmax_resp_len = 100\noverlong_buffer_cfg = { enable = true, len = 512 }\n",
            "reward.max_resp_len",
            ">= overlong_buffer_cfg.len",
        ),
        ("[worker]\nlog_format = 'xml'\n", "worker.log_format", "must be one of"),
        ("[worker]\nmetrics_port = 70000\n", "worker.metrics_port", "0..65535"),
        ("[connection]\nnamespace = 'a{b}'\n", "connection.namespace", "no braces"),
        ("[connection\n", "config", "not valid TOML"),
    ],
)
def test_invalid_config_fails_at_start_with_key_and_reason(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], text: str, key: str, reason: str
) -> None:
    config = write(tmp_path, "bad.toml", text)
    with pytest.raises(ConfigError) as err:
        load_settings(config, env={})
    assert err.value.key == key and reason in err.value.reason
    # Both entry points refuse to start, naming the key.
    assert main(["config", "show", "--config", config]) == 2
    assert main(["worker", "--config", config, "--redis", "redis://localhost:1"]) == 2
    err_text = capsys.readouterr().err
    assert key in err_text and reason in err_text


def test_invalid_environment_value_names_the_variable(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setenv("STREAM_REWARD_CONSUMER_MAX_DELIVERIES", "lots")
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert "consumer.max_deliveries" in err and "STREAM_REWARD_CONSUMER_MAX_DELIVERIES" in err and "integer" in err


def test_worker_without_redis_anywhere_is_a_config_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["worker", "--burst"]) == 2
    assert "connection.redis" in capsys.readouterr().err
    assert main(["status"]) == 2
    assert "connection.redis" in capsys.readouterr().err


def test_env_names_always_carry_their_section() -> None:
    assert env_name("quota.max_rpm") == "STREAM_REWARD_QUOTA_MAX_RPM"
    assert env_name("connection.redis") == "STREAM_REWARD_CONNECTION_REDIS"
    assert env_name("reward.overlong_buffer_cfg") == "STREAM_REWARD_REWARD_OVERLONG_BUFFER_CFG"
    for section, keys in schema().items():
        for key in keys:
            assert env_name(f"{section}.{key}") == f"STREAM_REWARD_{section}_{key}".upper()


def test_old_env_names_still_work_with_a_warning() -> None:
    with pytest.warns(ConfigDeprecationWarning, match=r"\$STREAM_REWARD_MAX_RPM is deprecated.*QUOTA_MAX_RPM"):
        s = load_settings(None, env={"STREAM_REWARD_MAX_RPM": "20"})
    assert s["quota.max_rpm"] == 20 and s.source("quota.max_rpm") == "env"
    # The new name wins over the old one, silently: the old one is not read at all.
    s = load_settings(None, env={"STREAM_REWARD_MAX_RPM": "20", "STREAM_REWARD_QUOTA_MAX_RPM": "30"})
    assert s["quota.max_rpm"] == 30


def test_env_parses_json_and_null(monkeypatch: pytest.MonkeyPatch) -> None:
    env = {
        "STREAM_REWARD_REWARD_OVERLONG_BUFFER_CFG": '{"enable": false}',
        "STREAM_REWARD_REWARD_NUM_PROCESSES": "none",
        "STREAM_REWARD_WORKER_LOG_LEVEL": "debug",
    }
    s = load_settings(None, env=env)
    assert s["reward.overlong_buffer_cfg"] == {"enable": False}
    assert s["reward.num_processes"] is None
    assert s["worker.log_level"] == "DEBUG"


# ---------------------------------------------------------------------- secrets
def test_secrets_are_masked_everywhere(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    config = write(
        tmp_path,
        "sr.toml",
        f"""
[connection]
redis = "redis://default:{SECRET}@db.internal:6379/0"
[reward]
reward_kwargs = {{ api_key = "{SECRET}", endpoint = "https://user:{SECRET}@judge.internal/v1", headers = {{ Authorization = "Bearer {SECRET}" }}, max_tokens = 512 }}
""",
    )
    out = show(capsys, "--config", config)
    text = json.dumps(out)
    assert SECRET not in text
    assert out["config"]["connection"]["redis"] == "redis://***@db.internal:6379/0"
    kwargs = out["config"]["reward"]["reward_kwargs"]
    assert kwargs["api_key"] == "***" and kwargs["headers"]["Authorization"] == "***"
    assert kwargs["endpoint"] == "https://***@judge.internal/v1"
    assert kwargs["max_tokens"] == 512  # "tokens" is not a secret
    assert out["config"]["quota"]["estimated_tokens_per_request"] == 2000

    assert main(["config", "show", "--config", config]) == 0  # the table form
    assert SECRET not in capsys.readouterr().out

    # From the environment, and in an error message about the URL itself.
    monkeypatch.setenv("STREAM_REWARD_CONNECTION_REDIS", f"http://admin:{SECRET}@db.internal")
    assert main(["config", "show"]) == 2
    err = capsys.readouterr().err
    assert "connection.redis" in err and SECRET not in err and "***" in err


def test_secret_type_errors_do_not_echo_the_value() -> None:
    with pytest.raises(ConfigError) as err:
        load_settings(None, env={}, flags={"connection.redis": [f"redis://:{SECRET}@db"]})
    assert err.value.key == "connection.redis" and SECRET not in str(err.value)
    with pytest.raises(ConfigError) as err:  # a mapping with a secret in the wrong place: masked too
        load_settings(None, env={}, flags={"reward.max_resp_len": {"api_key": SECRET}})
    assert err.value.key == "reward.max_resp_len" and SECRET not in str(err.value)
    assert mask_secrets({"password": "x", "nested": [{"token": "y"}], "n": 1}) == {
        "password": "***",
        "nested": [{"token": "***"}],
        "n": 1,
    }


# ---------------------------------------------------------------------- logging
def test_json_log_lines() -> None:
    stream = io.StringIO()
    configure_logging("INFO", "json", stream=stream)
    logging.getLogger("stream_reward.test").info("worker %s joined", "w1", extra={"batch": "b7"})
    logging.getLogger("stream_reward.test").debug("not shown")
    lines = stream.getvalue().splitlines()
    assert len(lines) == 1
    record = json.loads(lines[0])
    assert record["msg"] == "worker w1 joined" and record["level"] == "INFO"
    assert record["logger"] == "stream_reward.test" and record["batch"] == "b7" and "ts" in record


def test_json_formatter_includes_exceptions() -> None:
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        record = logging.LogRecord("x", logging.ERROR, __file__, 1, "failed", None, sys.exc_info())
    assert "RuntimeError: boom" in json.loads(JsonFormatter().format(record))["exc"]


def test_configure_logging_replaces_its_own_handler() -> None:
    configure_logging("INFO", "text")
    configure_logging("WARNING", "json")
    ours = [h for h in logging.getLogger().handlers if getattr(h, "_stream_reward", False)]
    assert len(ours) == 1 and isinstance(ours[0].formatter, JsonFormatter)


def test_library_modules_do_not_configure_logging() -> None:
    """Only entry points install handlers; library modules just get their logger."""
    import stream_reward

    root = Path(stream_reward.__file__).parent
    offenders = [
        p.name
        for p in root.rglob("*.py")
        if p.name not in ("logs.py", "cli.py") and ("basicConfig(" in p.read_text() or "addHandler(" in p.read_text())
    ]
    assert offenders == []


# ---------------------------------------------------------------------- progress
def test_progress_bar_draws_only_on_a_terminal() -> None:
    from rich.console import Console

    terminal = io.StringIO()
    with progress_bar("scoring", total=3, console=Console(file=terminal, force_terminal=True, width=80)) as bar:
        assert bar.drawn
        bar.advance(2)
        bar()
        with progress_bar("nested", total=1) as inner:  # nests on the bar already on screen
            assert inner.drawn
            inner.advance()
    assert "scoring" in terminal.getvalue() and "3/3" in terminal.getvalue()

    piped = io.StringIO()
    with progress_bar("scoring", total=3, console=Console(file=piped, force_terminal=False)) as bar:
        assert not bar.drawn
        bar.advance(3)
    assert piped.getvalue() == ""
    with progress_bar("scoring", total=3, enabled=False) as bar:  # --json
        assert not bar.drawn


def test_help_lists_every_command(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        main(["--help"])
    out = capsys.readouterr().out
    for command in ("demo", "server", "worker", "produce", "collect", "score", "status", "config", "bench"):
        assert command in out


def test_worker_command_becomes_the_worker_program(redis_url: str, namespace: str) -> None:
    """`stream-reward worker` execs `python -m workers` in its own process: it scores, and exits 0 in burst mode."""
    import asyncio
    import subprocess
    import sys

    from stream_reward import ProducerConfig, RolloutProducer, Trajectory
    from stream_reward.trainer.aggregator import RewardAggregator

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
