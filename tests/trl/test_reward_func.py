"""``stream_reward.trl.reward_func``: TRL's reward-function form on real workers.

Called here as TRL 1.16's GRPOTrainer calls it (``prompts=, completions=,
completion_ids=, **columns`` plus its ``trainer_state`` / ``log_metric`` kwargs), with
no TRL installed: the embedded server and local workers the function starts itself,
or a session server and workers started by the test.
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

from stream_reward.errors import BadCallError, ConfigError, WorkersDiedError
from stream_reward.trl import reward_func
from stream_reward.trl import shared as trl_shared

SCORERS = Path(__file__).resolve().parents[1] / "data" / "trl_scorers.py"
ECHO = f"python:{SCORERS}:echo"
LENGTH = f"python:{SCORERS}:length"


def call(fn: Any, prompts: list[Any], completions: list[Any], **columns: Any) -> list[float | None]:
    """As TRL's async path does: on a loop of its own, with its own kwargs beside the columns."""
    ids = [[0] * max(1, len(str(c))) for c in completions]
    return asyncio.run(
        fn(prompts=prompts, completions=completions, completion_ids=ids, trainer_state=object(), **columns)
    )


def msg(role: str, content: Any) -> dict[str, Any]:
    return {"role": role, "content": content}


def test_string_and_conversational_completions_score_alike() -> None:
    fn = reward_func(scorer="rules", data_source="openai/gsm8k", processes=1)
    texts = ["so #### 42", "so #### 41", "#### 7"]
    truths = ["42", "42", "7"]
    plain = call(fn, ["q"] * 3, texts, solution=truths)
    chat = call(
        fn,
        [[msg("system", "be brief"), msg("user", "q")]] * 3,
        [[msg("assistant", t)] for t in texts],
        solution=truths,
    )
    assert plain == chat == [1.0, 0.0, 1.0]


def test_a_conversational_completion_is_scored_on_its_last_assistant_text() -> None:
    fn = reward_func(scorer=LENGTH, data_source="any", ground_truth_key=None, processes=1)
    completions = [
        [msg("assistant", "abc")],
        [msg("assistant", None), msg("tool", "ignored tool output"), msg("assistant", "abcde")],  # a tool turn
        [msg("assistant", [{"type": "text", "text": "ab"}, {"type": "image"}, {"type": "text", "text": "cd"}])],
        [msg("tool", "no assistant turn at all")],
    ]
    assert call(fn, ["q"] * 4, completions) == [3.0, 5.0, 4.0, 0.0]


def test_a_scorer_that_raises_fails_that_sample_only_and_order_holds() -> None:
    fn = reward_func(scorer=ECHO, data_source="any", processes=1)
    truths = [str(i) for i in range(24)]
    truths[5] = truths[17] = "boom"
    metrics: list[tuple[str, float]] = []
    out = call(fn, ["q"] * 24, ["a"] * 24, solution=truths, log_metric=lambda k, v: metrics.append((k, v)))
    expected = [None if t == "boom" else float(t) for t in truths]
    assert out == expected
    assert metrics == [("stream_reward/failed_frac", 2 / 24)]


def test_other_columns_reach_the_scorer_as_extra_info() -> None:
    fn = reward_func(scorer=ECHO, data_source="any", ground_truth_key="answer", processes=1)
    out = call(fn, ["q", "q"], ["a", "b"], answer=["1", "2"], bonus=[0.5, 0.25], log_extra=print)
    assert out == [1.5, 2.25]


def test_the_data_source_column_routes_each_sample() -> None:
    fn = reward_func(scorer="rules", processes=1)
    out = call(
        fn,
        ["q", "q"],
        ["#### 3", "Answer: 3"],
        solution=["3", "4"],
        data_source=["openai/gsm8k", "math_dapo"],
    )
    assert out == [1.0, -1.0]


def test_the_prompt_reaches_the_sandbox() -> None:
    # The test calls helper(), which only the task's prompt defines: it passes only
    # when the last user message reached the sandbox as the prompt. Without it, the
    # sample is ours to fix (unresolved_name): None, not a 0 the policy earned.
    fn = reward_func(scorer="sandbox", data_source="code", processes=1)
    gt = json.dumps(
        {"test": "def check(candidate):\n    assert candidate() == helper() + 1\n", "entry_point": "answer"}
    )
    task = msg("user", "def helper():\n    return 41\n\ndef answer():\n    '''helper() + 1'''\n")
    answer = [msg("assistant", "```python\ndef answer():\n    return 42\n```")]
    prompts = [[msg("system", "Write Python."), task], [msg("system", "Write Python."), msg("user", "no task")]]
    assert call(fn, prompts, [answer, answer], solution=[gt, gt]) == [1.0, None]


def test_the_pool_starts_once_across_calls_and_threads(namespace: str) -> None:
    # A namespace of its own: a key no other test has started, so the four threads race to start it.
    fn = reward_func(scorer=ECHO, data_source="any", processes=1, name="once", namespace=namespace)
    other = reward_func(scorer=ECHO, data_source="any", processes=1, name="once_too", namespace=namespace)
    results: dict[int, list[float | None]] = {}
    errors: list[BaseException] = []
    start = threading.Barrier(4)

    def worker(k: int) -> None:
        try:
            start.wait(timeout=30)
            results[k] = call(fn if k % 2 else other, ["q"] * 3, ["a"] * 3, solution=[str(k), "1", "2"])
        except BaseException as exc:  # reported in the test's thread
            errors.append(exc)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=100)
    assert errors == []
    assert results == {k: [float(k), 1.0, 2.0] for k in range(4)}
    assert call(fn, ["q"], ["a"], solution=["9"]) == [9.0]
    runtime = trl_shared._current()
    pools = [p for k, p in runtime.pools.items() if k.namespace == namespace]
    assert len(pools) == 1  # two functions with the same workers share them
    assert pools[0].pipeline is not None and len(pools[0].pipeline.workers) == 1
    assert pools[0].url == runtime.server.url  # and every pool the one embedded server
    assert fn.__name__ == "once" and other.__name__ == "once_too"


def test_called_from_inside_a_running_loop_and_from_sync_code() -> None:
    fn = reward_func(scorer=ECHO, data_source="any", processes=1)

    async def inside() -> list[list[float | None]]:
        # Two calls at once on the caller's loop, which keeps running meanwhile.
        ticks = 0

        async def tick() -> None:
            nonlocal ticks
            while True:
                ticks += 1
                await asyncio.sleep(0)

        async def call(solution: str) -> list[float | None]:
            before = ticks
            out = await fn(["q"], ["a"], solution=[solution])
            # A call that blocked the loop while it waited (on a thread, a process) would
            # let no tick run in between; one that awaits lets the loop run on.
            assert ticks > before, "the caller's loop was blocked for the whole call"
            return out

        ticker = asyncio.ensure_future(tick())
        out = await asyncio.gather(call("1"), call("2"))
        ticker.cancel()
        return list(out)

    assert asyncio.run(inside()) == [[1.0], [2.0]]
    # From plain sync code, as TRL's trainer thread does: on a loop running in another thread.
    loop = asyncio.new_event_loop()
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    try:
        future = asyncio.run_coroutine_threadsafe(fn(["q"], ["a"], solution=["3"]), loop)
        assert future.result(timeout=60) == [3.0]
    finally:
        loop.call_soon_threadsafe(loop.stop)
        thread.join(timeout=10)
        loop.close()
    assert asyncio.run(fn(["q"], ["a"], solution=["4"])) == [4.0]  # a new loop per call


def test_an_empty_call_returns_an_empty_list() -> None:
    fn = reward_func(scorer=ECHO, data_source="any", processes=1)
    assert asyncio.run(fn([], [], completion_ids=[], solution=[])) == []


def test_a_missing_ground_truth_column_names_it_and_the_columns_passed() -> None:
    fn = reward_func(scorer=ECHO, data_source="any", processes=1)
    with pytest.raises(ConfigError) as info:
        call(fn, ["q"], ["a"], answer=["1"], level=[3])
    message = str(info.value)
    assert "'solution'" in message and "answer, level" in message
    assert "trainer_state" not in message and "\n" not in message


def test_columns_of_the_wrong_length_are_refused_before_anything_is_enqueued() -> None:
    fn = reward_func(scorer=ECHO, data_source="any", processes=1)
    with pytest.raises(BadCallError, match=r"column 'solution' has 1 values for 2 completions"):
        call(fn, ["q", "q"], ["a", "b"], solution=["1"])
    with pytest.raises(BadCallError, match=r"2 prompts for 1 completions"):
        asyncio.run(fn(["q", "q"], ["a"], solution=["1"]))
    with pytest.raises(BadCallError, match=r"completions\[0\] is a list, but not of \{'role', 'content'\} messages"):
        asyncio.run(fn(["q"], [["just text"]], solution=["1"]))
    with pytest.raises(BadCallError, match=r"completion_ids\[1\] is a NoneType, not a list of token ids"):
        asyncio.run(fn(["q", "q"], ["a", "b"], completion_ids=[[1], None], solution=["1", "2"]))


def test_no_data_source_anywhere_is_refused() -> None:
    fn = reward_func(scorer=ECHO, processes=1)
    with pytest.raises(ConfigError, match="no data_source column"):
        call(fn, ["q"], ["a"], solution=["1"])


def test_bad_arguments_are_refused_at_construction(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="'scorer'.*run elsewhere"):
        reward_func("redis://127.0.0.1:6379/0", scorer="rules")
    with pytest.raises(ConfigError, match="'config'.*no such file"):
        reward_func(config=tmp_path / "missing.toml")
    with pytest.raises(ConfigError, match="'timeout_s'"):
        reward_func(timeout_s=0)
    with pytest.raises(ConfigError, match="'processes'"):
        reward_func(processes=0)
    with pytest.raises(ConfigError, match="'namespace'"):
        reward_func(namespace="a{b}")


def test_workers_that_cannot_load_the_scorer_fail_the_call_naming_why(tmp_path: Path) -> None:
    fn = reward_func(scorer=f"python:{tmp_path / 'nowhere.py'}:score", data_source="any", processes=1)
    with pytest.raises(WorkersDiedError, match="nowhere.py"):
        call(fn, ["q"], ["a"], solution=["1"])


def test_with_a_url_it_only_produces_and_collects(redis_url: str, namespace: str, spawn_workers: Any) -> None:
    spawn_workers(1, "--scorer", ECHO)
    fn = reward_func(redis_url, namespace=namespace, data_source="any")
    assert call(fn, ["q", "q"], ["a", "b"], solution=["1", "boom"]) == [1.0, None]
    pools = [p for k, p in trl_shared._current().pools.items() if k.namespace == namespace]
    assert [p.pipeline for p in pools] == [None]


def test_samples_not_scored_by_the_deadline_are_none(redis_url: str, namespace: str) -> None:
    fn = reward_func(redis_url, namespace=namespace, data_source="any", timeout_s=0.5)  # no worker reads
    assert call(fn, ["q", "q"], ["a", "b"], solution=["1", "2"]) == [None, None]


def test_interpreter_exit_stops_the_server_and_workers() -> None:
    code = f"""
import asyncio
from stream_reward.trl import reward_func, shared
fn = reward_func(scorer={ECHO!r}, data_source="any", processes=2)
assert asyncio.run(fn(["q"], ["a"], solution=["1"])) == [1.0]
runtime = shared._current()
pids = [runtime.server.pid] + [p.pid for pool in runtime.pools.values() for p in pool.pipeline.workers]
print(" ".join(map(str, pids)))
"""
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=90, env=env)
    assert out.returncode == 0, out.stderr
    pids = [int(p) for p in out.stdout.split()]
    assert len(pids) == 3
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
            alive.append(pid)
        except ProcessLookupError:
            pass
    assert alive == []
    assert "Traceback" not in out.stderr and "WARNING" not in out.stderr, out.stderr


def test_a_sample_the_stream_cannot_carry_is_none_and_the_others_are_scored() -> None:
    """A column value over the message limit (a code dataset's test cases, say) or one
    msgpack cannot hold (an integer past 64 bits) fails its own sample, named in the
    warning, as the score command fails an oversized line: no exception out of the
    trainer's step, no batch left open until its deadline."""
    fn = reward_func(scorer=ECHO, data_source="any", processes=1, timeout_s=30)
    scores = call(
        fn, ["q"] * 3, ["a", "b", "c"], solution=["1", "2", "3"], tests=["x", "y" * (5 << 20), "z"], big=[0, 0, 2**70]
    )
    assert scores == [1.0, None, None]


def test_a_text_part_without_text_is_no_text() -> None:
    fn = reward_func(scorer=LENGTH, data_source="any", ground_truth_key=None, processes=1)
    parts = [{"type": "text", "text": None}, {"type": "text", "text": "ab"}]
    assert call(fn, ["q"], [[msg("assistant", parts)]]) == [2.0]


def test_two_functions_with_different_scorers_called_at_once_score_each_with_its_own() -> None:
    """TRL's async path awaits every reward function of a step together: an accuracy and
    a length function, each on its own pool, never score each other's samples."""
    accuracy = reward_func(scorer=ECHO, data_source="any", processes=1, name="accuracy")
    length = reward_func(scorer=LENGTH, data_source="any", processes=1, name="length")
    completions = ["aaaa", "bbbbb", "cccccc"] * 20  # lengths 4-6, answers 1-3: a mix-up shows

    async def step() -> list[list[float | None]]:
        columns = {"solution": ["1", "2", "3"] * 20, "trainer_state": object()}
        return list(
            await asyncio.gather(
                *(fn(prompts=["q"] * 60, completions=completions, **columns) for fn in (accuracy, length, accuracy))
            )
        )

    first, lengths, again = asyncio.run(step())
    assert first == again == [1.0, 2.0, 3.0] * 20
    assert lengths == [4.0, 5.0, 6.0] * 20
