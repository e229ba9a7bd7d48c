"""The three overrides on verl's RewardLoopManager, its RewardLoopWorker actors on a
local Ray: the same rm_scores as verl's naive manager, one shared server for the job."""

from __future__ import annotations

import time

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


def wait_until(condition, timeout_s: float = 60.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.25)
