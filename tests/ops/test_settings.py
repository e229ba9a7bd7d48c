"""Settings: one value per key from the config file (TOML, YAML or JSON), the environment
(``STREAM_REWARD_<SECTION>_<KEY>``) and flags, in that order of precedence, each key's source
known. A bad value fails at start, naming its key (and its variable) and the reason; the old
names still work with a deprecation warning; a secret (passwords in URLs, keys and tokens in
kwargs) never shows, not in ``config show`` nor in an error message.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from stream_reward.cli import main
from stream_reward.errors import ConfigDeprecationWarning, ConfigError
from stream_reward.ops.settings import env_name, load_settings, mask_secrets, schema

pytestmark = pytest.mark.usefixtures("clean_env", "restore_logging")

SECRET = "hunter2-s3cret"


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


# ---------------------------------------------------------------------- environment names
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
