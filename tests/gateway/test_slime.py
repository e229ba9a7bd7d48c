"""``POST /slime``: slime's remote_rm contract through a real gateway and real workers:
one sample in, ``{"score", "status", ...extra}`` (or the bare float) out; the optional
keys reach the scorer; a failed sample is a 503, or 0.0 marked failed."""

from __future__ import annotations

import pytest
from gateway_support import ECHO, HELPER_GT, HELPER_TASK, enqueued, gateway, post, sandbox_worker_args

pytestmark = pytest.mark.anyio


async def test_one_sample_scores_with_its_extra_info(redis_url, namespace, spawn_workers) -> None:
    spawn_workers(1, "--scorer", ECHO)
    async with gateway(redis_url, namespace, data_source="default-src") as gw:
        status, reply = await post(f"{gw.url}/slime", {"prompt": "What is 2+2?", "response": "4", "label": "4"})
        _, wrong = await post(f"{gw.url}/slime", {"prompt": "What is 2+2?", "response": "5", "label": "4"})
        _, bare = await post(f"{gw.url}/slime?reply=float", {"prompt": "q", "response": "4", "label": "4"})
    assert status == 200
    assert reply["score"] == 1.0 and reply["status"] == "ok" and reply["source"] == "default-src"
    assert wrong["score"] == 0.0 and wrong["status"] == "ok"  # a wrong answer is a score, not a failure
    assert bare == 1.0


async def test_optional_keys_and_a_chat_prompt_are_honoured(redis_url, namespace, spawn_workers) -> None:
    spawn_workers(1, "--scorer", ECHO)
    body = {
        "prompt": [{"role": "system", "content": "be brief"}, {"role": "user", "content": "2+2?"}],
        "response": "4",
        "label": "4",
        "data_source": "own-src",
        "extra_info": {"tag": "t1"},
        "metadata": {"k": 7},
    }
    async with gateway(redis_url, namespace, data_source="default-src") as gw:
        status, reply = await post(f"{gw.url}/slime", body)
        _, from_meta = await post(f"{gw.url}/slime", {"response": "4", "label": "4", "metadata": {"data_source": "m"}})
    assert status == 200, reply
    assert (reply["source"], reply["tag"], reply["meta_k"]) == ("own-src", "t1", 7)
    assert from_meta["source"] == "m"


async def test_a_failed_sample_is_a_503_or_a_marked_zero(redis_url, namespace, spawn_workers) -> None:
    spawn_workers(1, "--scorer", ECHO, "--retries", "0")
    sample = {"prompt": "q", "response": "raise", "label": "4"}
    async with gateway(redis_url, namespace, data_source="s") as gw:
        status, reply = await post(f"{gw.url}/slime", sample)
    async with gateway(redis_url, namespace, data_source="s", on_failure="zero") as gw:
        status_zero, zero = await post(f"{gw.url}/slime", sample)
    assert status == 503 and reply["failed"][0]["index"] == 0 and reply["failed"][0]["reason"]
    assert "score" not in reply
    assert status_zero == 200
    assert zero["score"] == 0.0 and zero["status"] == "failed" and zero["failed"] == 1 and zero["reason"]


@pytest.mark.parametrize(
    ("body", "says"),
    [
        ({"prompt": "q", "label": "4"}, "missing field 'response'"),
        ({"prompt": "q", "response": 4}, "'response' must be a string"),
        ({"prompt": 3, "response": "4"}, "'prompt' must be a string or a list"),
        ({"prompt": [{"role": "user"}], "response": "4"}, "message 0"),
        ({"response": "4", "metadata": "x"}, "'metadata' must be an object"),
        ({"response": "4", "extra_info": [1]}, "'extra_info' must be an object"),
        ([{"response": "4"}], "one sample"),
    ],
)
async def test_malformed_samples_are_400_and_enqueue_nothing(redis_url, namespace, body, says: str) -> None:
    async with gateway(redis_url, namespace, data_source="s") as gw:
        status, reply = await post(f"{gw.url}/slime", body)
        assert (await enqueued(redis_url, namespace)) == (0, 0)
    assert status == 400 and says in reply["error"], reply


async def test_an_unknown_reply_shape_is_a_400(redis_url, namespace) -> None:
    async with gateway(redis_url, namespace, data_source="s") as gw:
        status, reply = await post(f"{gw.url}/slime?reply=xml", {"response": "4"})
    assert status == 400 and "reply" in reply["error"]


async def test_metadata_nested_past_the_json_parsers_depth_is_a_400(redis_url, namespace) -> None:
    raw = b'{"response": "4", "metadata": ' + b'{"a": ' * 100_000 + b"1" + b"}" * 100_000 + b"}"
    async with gateway(redis_url, namespace, data_source="s") as gw:
        status, reply = await post(f"{gw.url}/slime", None, raw=raw)
        assert (await enqueued(redis_url, namespace)) == (0, 0)
    assert status == 400 and "malformed JSON" in reply["error"], reply


async def test_a_scored_sample_whose_extra_info_is_not_finite_answers_its_score(
    redis_url, namespace, spawn_workers
) -> None:
    """The score is fine; extra info JSON cannot hold (NaN, inf) is null, not a 500 that
    slime retries and then raises on."""
    spawn_workers(1, "--scorer", ECHO)
    async with gateway(redis_url, namespace, data_source="s") as gw:
        status, reply = await post(f"{gw.url}/slime", {"prompt": "q", "response": "nan-extra", "label": "x"})
    assert status == 200, reply
    assert reply["score"] == 1.0 and reply["status"] == "ok"
    assert reply["ratio"] is None and reply["spread"] == [1.0, None]


async def test_a_code_tasks_chat_prompt_reaches_the_sandbox(redis_url, namespace, spawn_workers) -> None:
    spawn_workers(1, *sandbox_worker_args())
    prompt = [
        {"role": "system", "content": "Write Python."},
        {"role": "user", "content": f"Complete:\n```python\n{HELPER_TASK}```"},
    ]
    own_helper = "```python\ndef helper():\n    return 0\n\ndef answer():\n    return 1\n```"
    async with gateway(redis_url, namespace, data_source="code") as gw:
        _, honest = await post(
            f"{gw.url}/slime",
            {"prompt": prompt, "response": "```python\ndef answer():\n    return 42\n```", "label": HELPER_GT},
        )
        _, hack = await post(f"{gw.url}/slime", {"prompt": prompt, "response": own_helper, "label": HELPER_GT})
    assert (honest["score"], honest["status"]) == (1.0, "ok"), honest
    assert (hack["score"], hack["status"]) == (0.0, "ok"), hack
