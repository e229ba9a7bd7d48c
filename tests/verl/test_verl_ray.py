"""The three overrides on verl's RewardLoopManager, its RewardLoopWorker actors on a
local Ray: the same rm_scores as verl's naive manager, one shared server for the job;
and the same reward_extra_info columns from every actor, whatever samples each saw
(a custom function failing on every sample of one actor, a composite component's own
key on the first sample only)."""

from __future__ import annotations

import textwrap
import time

import numpy as np
import pytest
import ray
import torch
from verl.experimental.reward_loop import RewardLoopManager
from verl_support import ROWS, STREAM_OVERRIDES, make_batch

from stream_reward.verl.server import RAY_NAMESPACE


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


@pytest.fixture(scope="module")
def local_ray(monkeypatch_module):
    monkeypatch_module.setenv("RAY_AUTH_MODE", "disabled")  # a local test cluster: no token file
    ray.init(num_cpus=8, include_dashboard=False, log_to_driver=False, namespace="stream-reward-tests")
    yield
    ray.shutdown()


def shared_actors() -> list[dict]:
    return [
        a
        for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == RAY_NAMESPACE and a["name"].startswith("stream-reward-")
    ]


@pytest.mark.timeout(600)
def test_reward_loop_manager_on_ray(local_ray, compose, tokenizer) -> None:
    data = make_batch(tokenizer, ROWS * 4)
    theirs = RewardLoopManager(compose("reward.num_workers=2"))
    expected = theirs.compute_rm_score(data)
    # verl names its workers reward_loop_worker_{i}: one RewardLoopManager per job at a time.
    for handle in theirs.reward_loop_workers:
        ray.kill(handle)
    # Without all_namespaces, Ray lists bare names.
    wait_until(lambda: not any(n.startswith("reward_loop_worker_") for n in ray.util.list_named_actors()))
    ours = RewardLoopManager(
        compose("reward.num_workers=2", *STREAM_OVERRIDES, "+reward.reward_kwargs.server_lease_s=4")
    )
    got = ours.compute_rm_score(data)
    assert torch.equal(got.batch["rm_scores"], expected.batch["rm_scores"])
    keys = got.meta_info["reward_extra_keys"]
    assert {"acc", "reward_failed", "reward_status"} <= set(keys)
    assert list(got.non_tensor_batch["reward_failed"]) == [0.0] * len(data)

    # One server and one worker pool for the whole job, not one per RewardLoopWorker.
    actors = shared_actors()
    assert len(actors) == 1, actors
    shared = ray.get_actor(actors[0]["name"], namespace=RAY_NAMESPACE)
    info = ray.get(shared.info.remote())
    assert info["clients"] == 2 and info["workers_alive"] == info["workers"] == 2

    # The agent loop's path: a worker handle's compute_score, one trajectory at a time.
    handles = ours.reward_loop_worker_handles
    singles = ray.get([handles[i % 2].compute_score.remote(data[i : i + 1]) for i in range(len(data))])
    scores = [s["reward_score"] for s in singles]
    assert torch.equal(ours.reward_manager_cls.assemble_rm_scores(data, scores), expected.batch["rm_scores"])

    # It stops with the job: once no RewardLoopWorker renews its lease, it exits.
    for handle in ours.reward_loop_workers:
        ray.kill(handle)
    wait_until(lambda: not shared_actors())


# Sample i's extra_info is {"index": i}; with 8 rows and 2 actors, actor 0 scores rows 0-3.
FUNCTIONS = textwrap.dedent(
    """
    def custom(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        i = extra_info["index"]
        if i < 4 or i == 6:  # every sample of the first actor, and one of the second
            raise ValueError(f"sample {i} cannot be scored")
        return {"score": 1.0, "pred": f"p{i}", "noise": i}

    import asyncio

    async def tag(data_source, solution_str, ground_truth, extra_info=None, counter=None, **kwargs):
        i = extra_info["index"]
        if i != 0:
            with open(counter, "a") as f:
                print(i, file=f)
            return 1.0
        # Row 0 alone has "hit", and answers once the 7 others were scored: no worker process
        # had seen the key while it scored them, nor has the second actor.
        loop = asyncio.get_running_loop()
        end = loop.time() + 120
        while loop.time() < end:
            with open(counter) as f:
                if len(f.read().split()) >= 7:
                    break
            await asyncio.sleep(0.01)
        return {"score": 1.0, "hit": i}

    async def check(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        if extra_info["index"] in (2, 5):
            raise RuntimeError("the checker is down")
        return 0.5
    """
)


def stop_workers(manager: RewardLoopManager) -> None:
    # verl names its workers reward_loop_worker_{i}: one RewardLoopManager per job at a time.
    for handle in manager.reward_loop_workers:
        ray.kill(handle)
    wait_until(lambda: not any(n.startswith("reward_loop_worker_") for n in ray.util.list_named_actors()))


def assert_one_value_per_sample(got, n: int) -> dict[str, list]:
    keys = got.meta_info["reward_extra_keys"]
    columns = {key: got.non_tensor_batch[key] for key in keys}
    assert all(isinstance(c, np.ndarray) and len(c) == n for c in columns.values()), columns
    return {key: list(column) for key, column in columns.items()}


@pytest.mark.timeout(600)
def test_every_actor_gives_every_sample_the_declared_columns(local_ray, compose, tokenizer, tmp_path) -> None:
    functions = tmp_path / "functions.py"
    functions.write_text(FUNCTIONS)
    data = make_batch(tokenizer, ROWS[:8])
    common = ("reward.num_workers=2", *STREAM_OVERRIDES, "+reward.reward_kwargs.server_lease_s=4")

    # A dict-returning custom function that raises, the first sample among the failures.
    custom = RewardLoopManager(
        compose(
            *common,
            f"reward.custom_reward_function.path={functions}",
            "reward.custom_reward_function.name=custom",
            "+reward.reward_kwargs.extra_keys=[pred]",
        )
    )
    try:
        columns = assert_one_value_per_sample(custom.compute_rm_score(data), 8)
    finally:
        stop_workers(custom)
    assert columns["reward_failed"] == [1.0] * 4 + [0.0, 0.0, 1.0, 0.0]
    assert columns["pred"] == [None] * 4 + ["p4", "p5", None, "p7"]  # failed samples: None, not a missing key
    assert "noise" not in columns  # undeclared: left out on every actor alike

    # A composite whose component has a key of its own on the first sample only, which the
    # other actor never sees, and a required component that fails a sample on each actor.
    counter = tmp_path / "scored"
    counter.write_text("")
    components = (
        f"[{{name:tag,scorer:'{functions}:tag',columns:[hit],reward_kwargs:{{counter:'{counter}'}}}},"
        f"{{name:check,scorer:'{functions}:check',retries:0}}]"
    )
    composite = RewardLoopManager(compose(*common, f"+reward.reward_kwargs.components={components}"))
    try:
        got = composite.compute_rm_score(data)
        columns = assert_one_value_per_sample(got, 8)
    finally:
        stop_workers(composite)
    assert columns["check_status"] == ["ok", "ok", "failed", "ok", "ok", "failed", "ok", "ok"]
    assert columns["reward_status"][2] == columns["reward_status"][5] == "check:scorer_error"
    assert columns["tag/hit"] == [0] + [None] * 7
    wait_until(lambda: not shared_actors())


def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.25)
