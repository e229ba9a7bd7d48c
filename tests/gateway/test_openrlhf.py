"""``POST /openrlhf``: OpenRLHF's remote_url contract through a real gateway and real
worker processes; failed samples are a 503 naming them (or 0.0 and counted with
``on_failure="zero"``); a malformed request is a 400/413 and enqueues nothing."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import pytest
from gateway_support import ECHO, HELPER_GT, HELPER_TASK, enqueued, gateway, openrlhf_body, post, sandbox_worker_args

from stream_reward.errors import ConfigError
from stream_reward.gateway.openrlhf import FAILURE_COLUMNS
from stream_reward.gateway.service import GatewayConfig
from stream_reward.ops.embedded import EmbeddedServer

pytestmark = pytest.mark.anyio


async def test_scores_come_back_in_order_with_the_declared_extra_logs(redis_url, namespace, spawn_workers) -> None:
    spawn_workers(1, "--scorer", ECHO)
    body = openrlhf_body(["Q1: ", "Q2: ", "Q3: "], ["4", "5", "x"], ["4", "6", "x"])
    async with gateway(redis_url, namespace, data_source="math", extra_logs=("len", "tag")) as gw:
        status, reply = await post(f"{gw.url}/openrlhf", body)
    assert status == 200, reply
    assert reply["rewards"] == [1.0, 0.0, 1.0] and reply["scores"] == reply["rewards"]
    logs = reply["extra_logs"]
    # Each value a list of numbers, one per sample (OpenRLHF makes tensors of them): the
    # declared keys (an all-null one as 0.0), the failure columns; the undeclared
    # string column (source) is left out.
    assert logs["len"] == [1.0, 1.0, 1.0] and logs["tag"] == [0.0, 0.0, 0.0]
    assert set(logs) == {"len", "tag", *FAILURE_COLUMNS}
    assert logs["failed"] == [0.0, 0.0, 0.0]


async def test_every_reply_has_the_same_extra_logs_keys_as_openrlhf_merges_them(
    redis_url, namespace, spawn_workers
) -> None:
    """OpenRLHF 0.11 sends one sample per request and merges a step's replies key by key,
    failing when a key is missing from one (its split_experience_batch length check):
    a failed sample's reply has the same keys as a scored one's."""
    spawn_workers(1, "--scorer", ECHO, "--retries", "0")
    async with gateway(redis_url, namespace, data_source="math", on_failure="zero", extra_logs=("len",)) as gw:
        replies = [
            (await post(f"{gw.url}/openrlhf", openrlhf_body(["q"], [response], ["1"])))[1]
            for response in ("1", "raise", "2")
        ]
    keys = [set(r["extra_logs"]) for r in replies]
    assert keys[0] == keys[1] == keys[2], keys
    merged = {k: [v for r in replies for v in r["extra_logs"][k]] for k in keys[0]}
    assert all(len(values) == 3 for values in merged.values())
    assert merged["failed"] == [0.0, 1.0, 0.0] and merged["failed_scorer"] == [0.0, 1.0, 0.0]


async def test_a_failed_sample_is_a_503_naming_index_uid_and_reason(redis_url, namespace, spawn_workers) -> None:
    spawn_workers(1, "--scorer", ECHO, "--retries", "0")
    body = openrlhf_body(["a", "b", "c"], ["1", "raise", "3"], ["1", "2", "3"])
    async with gateway(redis_url, namespace, data_source="math") as gw:
        status, reply = await post(f"{gw.url}/openrlhf", body)
    assert status == 503, reply
    assert "1 of 3 samples failed" in reply["error"]
    [row] = reply["failed"]
    assert row["index"] == 1 and row["uid"].endswith("/1") and row["reason"]
    assert "rewards" not in reply  # no 0 the trainer could learn


async def test_on_failure_zero_answers_zero_and_counts_it(redis_url, namespace, spawn_workers) -> None:
    spawn_workers(1, "--scorer", ECHO, "--retries", "0")
    body = openrlhf_body(["a", "b", "c"], ["1", "raise", "3"], ["1", "2", "3"])
    async with gateway(redis_url, namespace, data_source="math", on_failure="zero") as gw:
        status, reply = await post(f"{gw.url}/openrlhf", body)
        _, clean = await post(f"{gw.url}/openrlhf", openrlhf_body(["a"], ["1"], ["1"]))
    assert status == 200, reply
    assert reply["rewards"] == [1.0, 0.0, 1.0]
    logs = reply["extra_logs"]
    assert logs["failed"] == [0.0, 1.0, 0.0]
    # The scorer raised: its class column marks the sample; the other classes are 0.
    assert logs["failed_scorer"] == [0.0, 1.0, 0.0]
    assert all(logs[k] == [0.0] * 3 for k in FAILURE_COLUMNS if k not in ("failed", "failed_scorer"))
    assert clean["extra_logs"]["failed"] == [0.0]  # the column is there in every reply


@pytest.mark.parametrize(
    ("raw", "says"),
    [
        (b"{not json", "malformed JSON"),
        (b"[1, 2]", "expected a JSON object"),
        (json.dumps({"prompts": ["a"], "labels": ["1"]}).encode(), "missing field 'query'"),
        (json.dumps({"query": ["a1"], "prompts": ["a"]}).encode(), "missing field 'labels'"),
        (json.dumps({"query": "a1", "prompts": ["a"], "labels": ["1"]}).encode(), "must be a list"),
        (json.dumps({"query": ["a1", 7], "prompts": ["a", "b"], "labels": [1, 2]}).encode(), "item 1 must be a string"),
        (json.dumps({"query": ["a1", "b2"], "prompts": ["a"], "labels": [1, 2]}).encode(), "lengths differ"),
        (json.dumps({"query": ["a1", "c2"], "prompts": ["a", "b"], "labels": [1, 2]}).encode(), "sample 1: query"),
        (json.dumps({"query": ["a1"], "prompts": ["a"], "labels": [1], "data_source": 3}).encode(), "data_source"),
        # JSON Python's parser refuses past its own limits (its recursion, its integer
        # digits): the client's fault, never a 500.
        (
            b'{"query": ["a1"], "prompts": ["a"], "labels": [' + b"[" * 100_000 + b"]" * 100_000 + b"]}",
            "malformed JSON",
        ),
        (b'{"query": ["a1"], "prompts": ["a"], "labels": [' + b"9" * 5000 + b"]}", "malformed JSON"),
    ],
)
async def test_malformed_requests_are_400_and_enqueue_nothing(redis_url, namespace, raw: bytes, says: str) -> None:
    async with gateway(redis_url, namespace, data_source="math") as gw:
        before = await enqueued(redis_url, namespace)
        status, reply = await post(f"{gw.url}/openrlhf", None, raw=raw)
        after = await enqueued(redis_url, namespace)
    assert status == 400, reply
    assert says in reply["error"] and "\n" not in reply["error"]
    assert after == before


async def test_no_data_source_anywhere_is_a_400(redis_url, namespace) -> None:
    async with gateway(redis_url, namespace) as gw:
        status, reply = await post(f"{gw.url}/openrlhf", openrlhf_body(["a"], ["1"], ["1"]))
        assert (await enqueued(redis_url, namespace)) == (0, 0)
    assert status == 400 and "--data-source" in reply["error"]


async def test_over_size_bodies_and_sample_counts_are_413(redis_url, namespace) -> None:
    async with gateway(redis_url, namespace, data_source="math", max_body_bytes=2000, max_samples=4) as gw:
        big = openrlhf_body(["a"], ["x" * 5000], ["1"])
        status_body, reply_body = await post(f"{gw.url}/openrlhf", big)
        many = openrlhf_body(["a"] * 5, ["1"] * 5, ["1"] * 5)
        status_many, reply_many = await post(f"{gw.url}/openrlhf", many)
        assert (await enqueued(redis_url, namespace)) == (0, 0)
    assert status_body == 413 and "2000 bytes" in reply_body["error"]
    assert status_many == 413 and "5 samples" in reply_many["error"]


async def test_a_request_nobody_scores_times_out_with_a_504(redis_url, namespace) -> None:
    # No worker reads the group: the request must answer within its timeout, not hang.
    async with gateway(redis_url, namespace, data_source="math", timeout_s=1.0) as gw:
        status, reply = await post(f"{gw.url}/openrlhf", openrlhf_body(["a", "b"], ["1", "2"], ["1", "2"]))
    assert status == 504, reply
    assert "timed out after 1s" in reply["error"] and "0 of 2" in reply["error"]


async def test_redis_unreachable_is_a_503_naming_it_never_a_hang(namespace) -> None:
    async with gateway("redis://127.0.0.1:1", namespace, data_source="math", timeout_s=3.0) as gw:
        status, reply = await post(f"{gw.url}/openrlhf", openrlhf_body(["a"], ["1"], ["1"]))
    assert status == 503, reply
    assert reply["error"].startswith("Redis unavailable") and "127.0.0.1:1" in reply["error"]


async def test_a_timeout_says_how_many_samples_were_done(redis_url, namespace, spawn_workers) -> None:
    # One sample hangs past the request's timeout; the others are scored: the 504 counts them.
    # No drain at the test's end: the hung sample would hold the worker's stop for its 10 s.
    spawn_workers(
        1, "--scorer", "python:tests/data/scorers.py:async_exact", "--concurrency", "4", "--drain-timeout-s", "0"
    )
    body = openrlhf_body(["a", "b", "c"], ["1", "hang", "3"], ["1", "2", "3"])
    async with gateway(redis_url, namespace, data_source="math", timeout_s=4.0) as gw:
        status, reply = await post(f"{gw.url}/openrlhf", body)
    assert status == 504, reply
    assert "2 of 3 samples scored" in reply["error"]


async def test_an_empty_request_answers_empty_lists_and_opens_no_batch(redis_url, namespace) -> None:
    async with gateway(redis_url, namespace, data_source="math") as gw:
        status, reply = await post(f"{gw.url}/openrlhf", {"query": [], "prompts": [], "labels": []})
        assert (await enqueued(redis_url, namespace)) == (0, 0)
    assert status == 200 and reply == {"rewards": [], "scores": [], "extra_logs": {k: [] for k in FAILURE_COLUMNS}}


@pytest.mark.parametrize(
    ("query", "label", "status"),
    [
        # JSON the parser takes that the stream cannot carry: a lone surrogate (not UTF-8),
        # an integer past 64 bits, a sample over the message limit (4 MiB).
        ('"a\\udc00"', '"1"', 400),
        ('"a1"', "1180591620717411303424", 400),
        ('"a' + "x" * (5 << 20) + '"', '"1"', 413),
    ],
)
async def test_a_sample_the_stream_cannot_carry_is_refused_naming_it_and_nothing_is_queued(
    redis_url, namespace, query: str, label: str, status: int
) -> None:
    # A good sample first: the refusal names the bad one, and neither is queued.
    raw = f'{{"query": ["q1", {query}], "prompts": ["q", "a"], "labels": ["1", {label}]}}'
    async with gateway(redis_url, namespace, data_source="math") as gw:
        code, reply = await post(f"{gw.url}/openrlhf", None, raw=raw.encode())
        entries, _ = await enqueued(redis_url, namespace)
    assert code == status, reply
    assert reply["error"].startswith("sample 1: ") and "\n" not in reply["error"]
    assert entries == 0


@pytest.mark.parametrize(
    ("prompt", "query"),
    [
        # OpenRLHF's query is tokenizer.decode(prompt tokens + response tokens), its prompt
        # the raw text: a tokenizer that normalizes (NFC/NFKC) or cleans up spaces before
        # punctuation (clean_up_tokenization_spaces) gives back another prompt text.
        ("Caf\u0065\u0301? ", "Caf\u00e9? 42"),
        ("Say hi ! Is it ok ? Answer: ", "Say hi! Is it ok? Answer: 42"),
    ],
)
async def test_a_prompt_the_tokenizer_gave_back_normalized_still_yields_the_response(
    redis_url, namespace, spawn_workers, prompt: str, query: str
) -> None:
    spawn_workers(1, "--scorer", ECHO)
    body = {"query": [query], "prompts": [prompt], "labels": ["42"]}
    async with gateway(redis_url, namespace, data_source="math", extra_logs=("len",)) as gw:
        status, reply = await post(f"{gw.url}/openrlhf", body)
    assert status == 200, reply
    assert reply["rewards"] == [1.0] and reply["extra_logs"]["len"] == [2.0]


async def test_redis_that_stops_answering_mid_request_is_a_504_naming_it_and_the_gateway_recovers(
    namespace, spawn_workers
) -> None:
    """A Redis that hangs (SIGSTOP: connections open, no answers) while requests wait:
    each answers 504 within its timeout plus slack, saying Redis did not answer (not
    "0 samples scored", which blames the workers); once it answers again, so does the gateway."""
    with EmbeddedServer() as server:
        assert server.pid is not None
        # No drain at the test's end: a stopped Redis would hold the worker's stop for its 10 s.
        spawn_workers(
            1, "--scorer", "python:tests/data/scorers.py:async_exact", "--drain-timeout-s", "0", url=server.url
        )
        body = openrlhf_body(["a"], ["hang"], ["1"])  # in flight when Redis stops
        async with gateway(server.url, namespace, data_source="math", timeout_s=3.0) as gw:
            in_flight = asyncio.create_task(post(f"{gw.url}/openrlhf", body))
            for _ in range(600):  # until its sample is in Redis: the request is collecting
                if (await enqueued(server.url, namespace))[0]:
                    break
                await asyncio.sleep(0.01)
            os.kill(server.pid, signal.SIGSTOP)
            started = time.monotonic()
            try:
                later, first = await asyncio.gather(
                    post(f"{gw.url}/openrlhf", openrlhf_body(["a"], ["1"], ["1"])), in_flight
                )
                elapsed = time.monotonic() - started
            finally:
                os.kill(server.pid, signal.SIGCONT)
            after = await post(f"{gw.url}/openrlhf", openrlhf_body(["a"], ["1"], ["1"]))
    for status, reply in (first, later):
        assert status == 504, reply
        assert "Redis did not answer" in reply["error"] and "\n" not in reply["error"]
    assert elapsed < 3.0 + 10  # the request's bound, with slack for a loaded machine: never a hang
    assert after[0] == 200 and after[1]["rewards"] == [1.0]


@pytest.mark.parametrize("key", ["failed", "failed_timeout"])
def test_an_extra_logs_key_that_would_overwrite_a_failure_column_is_refused(key: str) -> None:
    """A declared key named like the gateway's own failure columns would overwrite them
    with the scorer's value: a failed sample marked 0 there, the failure hidden."""
    with pytest.raises(ConfigError, match=f"{key!r}.*failure column"):
        GatewayConfig("redis://127.0.0.1:1", extra_logs=("acc", key))


async def test_undeclared_keys_from_the_data_are_warned_about_a_bounded_number_of_times(
    redis_url, namespace, spawn_workers, caplog
) -> None:
    """A scorer whose extra-info keys come from the data (a key per sample) must not make
    a warning per sample and a set of every key ever seen, for the gateway's lifetime."""
    spawn_workers(1, "--scorer", ECHO)
    n = 300
    body = openrlhf_body(["q"] * n, [f"key-{namespace}-{i}" for i in range(n)], ["1"] * n)
    async with gateway(redis_url, namespace, data_source="math") as gw:
        with caplog.at_level("WARNING", logger="stream_reward.gateway.openrlhf"):
            status, reply = await post(f"{gw.url}/openrlhf", body)
    assert status == 200, reply
    warnings = [r for r in caplog.records if r.name == "stream_reward.gateway.openrlhf"]
    assert len(warnings) <= 65  # 64 keys named, then one line for the rest


async def test_a_code_tasks_prompt_reaches_the_sandbox_and_the_responses_own_helper_does_not(
    redis_url, namespace, spawn_workers
) -> None:
    spawn_workers(1, *sandbox_worker_args())
    prompt = f"<|im_start|>user\nComplete:\n```python\n{HELPER_TASK}```<|im_end|>\n<|im_start|>assistant\n"
    honest = "```python\ndef answer():\n    return helper() + 1\n```"
    own_helper = "```python\ndef helper():\n    return 0\n\ndef answer():\n    return 1\n```"
    body = openrlhf_body([prompt, prompt], [honest, own_helper], [HELPER_GT, HELPER_GT])
    async with gateway(redis_url, namespace, data_source="code") as gw:
        status, reply = await post(f"{gw.url}/openrlhf", body)
        no_task, failed = await post(
            f"{gw.url}/openrlhf", openrlhf_body(["Write answer.\n"], [own_helper], [HELPER_GT])
        )
    assert status == 200, reply
    assert reply["rewards"] == [1.0, 0.0]
    # Without the task's code the test's helper is nobody's: our data's fault, never the response's pass.
    assert no_task == 503 and "unresolved_name" in json.dumps(failed), failed
