"""The install contract: the version, the [trainer] extra's clear error, a worker host without
torch, and ``produce --rate`` (the job asyncio-throttle is declared for)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import redis

import stream_reward
from stream_reward.cli import main
from stream_reward.errors import ConfigError, MissingExtraError, StreamRewardError
from stream_reward.trainer import tensors
from stream_reward.wire.entries import read_members
from stream_reward.wire.keys import Keys

ROOT = Path(__file__).resolve().parents[2]
GOOD = {"data_source": "openai/gsm8k", "response": "#### 6", "ground_truth": "6", "valid_response_length": 4}


def test_version_flag_prints_the_one_version(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as exit_:
        main(["--version"])
    assert exit_.value.code == 0
    assert capsys.readouterr().out.strip() == f"stream-reward {stream_reward.__version__}"
    # pyproject reads the version from the package; it is written nowhere else.
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert 'dynamic = ["version"]' in pyproject
    assert 'version = { attr = "stream_reward._version.__version__" }' in pyproject
    assert '\nversion = "' not in pyproject


def test_a_missing_tensor_library_names_the_extra(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)  # what an install without [trainer] looks like
    with pytest.raises(MissingExtraError) as caught:
        tensors.import_torch("the reward aggregator")
    assert "stream-reward[trainer]" in str(caught.value) and "the reward aggregator" in str(caught.value)
    assert isinstance(caught.value, StreamRewardError) and isinstance(caught.value, ImportError)
    from stream_reward.trainer.aggregator import RewardAggregator
    from stream_reward.trainer.rewards import place_scores

    with pytest.raises(MissingExtraError):
        RewardAggregator("redis://127.0.0.1:1")
    with pytest.raises(MissingExtraError):
        place_scores([1.0], [1], 4)


def test_no_module_imports_torch_or_numpy_at_import_time() -> None:
    """Worker hosts install without [trainer]: importing every module must not need torch or numpy."""
    code = (
        "import sys, pkgutil, importlib\n"
        "sys.modules['torch'] = None; sys.modules['numpy'] = None\n"
        "import stream_reward, workers\n"
        "for pkg in (stream_reward, workers):\n"
        "    for m in pkgutil.walk_packages(pkg.__path__, pkg.__name__ + '.'):\n"
        "        if not m.name.endswith('__main__'): importlib.import_module(m.name)\n"
        "print('ok')\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def _rollouts(tmp_path: Path, n: int) -> Path:
    path = tmp_path / "rollouts.jsonl"
    path.write_text("".join(json.dumps(GOOD) + "\n" for _ in range(n)))
    return path


def _entry_times_ms(redis_url: str, namespace: str) -> list[int]:
    client = redis.Redis.from_url(redis_url)
    try:
        entries = client.xrange(Keys(namespace).stream())
    finally:
        client.close()
    # One time per sample: an entry holds several (see wire/entries.py).
    return [int(entry_id.split(b"-")[0]) for entry_id, fields in entries for _ in read_members(fields) or ()]


def test_produce_rate_paces_the_replay(redis_url: str, namespace: str, tmp_path: Path) -> None:
    n, rate = 60, 100.0
    path = _rollouts(tmp_path, n)
    argv = ["produce", "--redis", redis_url, "--namespace", namespace, "--batch", "r1", "--rate", str(rate)]
    assert main([*argv, str(path)]) == 0
    times = _entry_times_ms(redis_url, namespace)
    assert len(times) == n
    # 60 at 100/s: chunks of 5 every 50 ms, the first at once, so the last leaves ~550 ms after the first.
    spread_ms = times[-1] - times[0]
    assert 450 <= spread_ms <= 5000, spread_ms
    # Steady, not a burst then a wait: no 100 ms window holds much more than its share (10).
    assert max(sum(1 for t in times if start <= t < start + 100) for start in times) <= 20


def test_produce_without_rate_is_not_paced(redis_url: str, namespace: str, tmp_path: Path) -> None:
    path = _rollouts(tmp_path, 60)
    assert main(["produce", "--redis", redis_url, "--namespace", namespace, "--batch", "r2", str(path)]) == 0
    times = _entry_times_ms(redis_url, namespace)
    assert len(times) == 60 and times[-1] - times[0] < 450  # the pacing test's bound is not met by accident


@pytest.mark.parametrize("rate", ["0", "-5", "nan", "inf"])
def test_produce_rejects_a_rate_that_is_not_positive(
    redis_url: str, namespace: str, tmp_path: Path, rate: str, capsys: pytest.CaptureFixture[str]
) -> None:
    path = _rollouts(tmp_path, 3)
    argv = ["produce", "--redis", redis_url, "--namespace", namespace, "--batch", "r3", "--rate", rate, str(path)]
    assert main(argv) == 2
    assert "produce.rate" in capsys.readouterr().err


def test_rate_error_is_a_config_error() -> None:
    assert issubclass(ConfigError, StreamRewardError)


@pytest.mark.skipif(
    not os.environ.get("STREAM_REWARD_TEST_BASE_INSTALL"),
    reason="builds a venv without [trainer]; .ci/run sets STREAM_REWARD_TEST_BASE_INSTALL=1",
)
def test_a_worker_runs_from_the_base_install(redis_url: str, namespace: str, tmp_path: Path) -> None:
    """``pip install stream-reward`` (no extras) pulls no torch, and a worker scores from it."""
    # A copy of the source: building in the checkout would leave build/ and *.egg-info behind.
    source = tmp_path / "src"
    for name in ("stream_reward", "workers", "benchmarks"):  # all the repo has: the wheel takes stream_reward alone
        shutil.copytree(ROOT / name, source / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy(ROOT / name, source / name)
    venv = tmp_path / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True, timeout=120)
    py = venv / "bin" / "python"
    subprocess.run(
        [str(py), "-m", "pip", "install", "-q", "--disable-pip-version-check", str(source)],
        check=True,
        timeout=600,
        capture_output=True,
    )
    listed = subprocess.run([str(py), "-m", "pip", "list"], capture_output=True, text=True, check=True).stdout
    names = {line.split()[0].lower() for line in listed.splitlines()[2:] if line.strip()}
    assert "torch" not in names and "numpy" not in names, names
    # The producer side (this interpreter) pushes; the torch-free worker scores.
    path = _rollouts(tmp_path, 5)
    assert main(["produce", "--redis", redis_url, "--namespace", namespace, "--batch", "w1", str(path)]) == 0
    # The installed command, as a worker host has it (``python -m workers`` is a checkout's).
    top = subprocess.run(
        [
            str(py),
            "-c",
            "import importlib.metadata as m; print(m.distribution('stream-reward').read_text('top_level.txt'))",
        ],
        capture_output=True,
        text=True,
        check=True,
        cwd=tmp_path,
    ).stdout.split()
    assert top == ["stream_reward"]
    bench = subprocess.run(
        [str(venv / "bin" / "stream-reward"), "bench", "--help"], capture_output=True, text=True, cwd=tmp_path
    )
    assert bench.returncode == 0 and "throughput" in bench.stdout, bench.stderr
    worker = subprocess.run(
        [str(venv / "bin" / "stream-reward"), "worker", "--redis", redis_url, "--namespace", namespace, "--burst"],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=tmp_path,  # not the checkout: the installed package, not the source tree
    )
    assert worker.returncode == 0, worker.stderr[-2000:]
    client = redis.Redis.from_url(redis_url)
    try:
        assert client.hlen(Keys(namespace).results("w1")) == 5
    finally:
        client.close()
