"""`stream-reward bench quota`: two processes sharing one quota print one JSON object
with the achieved rate against the quota."""

from __future__ import annotations

import json

import pytest


def test_quota_bench_prints_one_json_object(capsys: pytest.CaptureFixture[str]) -> None:
    from stream_reward.bench.quota import main

    assert main(["--duration-s", "2", "--quota-rpm", "1200", "--json"]) == 0
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    result = json.loads(out[0])
    for key in ("quota_rpm", "achieved_rpm", "utilization", "http_429", "processes"):
        assert key in result
    assert result["processes"] == 2 and result["quota_rpm"] == 1200
    # Only sanity here (a busy test machine skews short runs); the bench itself targets >= 0.97.
    assert 0.3 < result["utilization"] <= 1.1
