"""Each bench end to end at a tiny size: one JSON object on stdout with the promised
keys, and the basic bookkeeping right (everything pushed got scored). No timing
assertions: the machine running the tests is not a benchmark machine."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest

from stream_reward.bench import (
    composite,
    faults,
    gateway,
    latency,
    math_verify,
    memory,
    overlap,
    per_sample,
    quota,
    throughput,
    vs_verl,
)


def run_json(capsys: pytest.CaptureFixture[str], module: Any, argv: list[str]) -> dict[str, Any]:
    assert module.main([*argv, "--json"]) == 0
    out = capsys.readouterr().out
    assert out.count("\n") == 1, f"--json must print exactly one line on stdout, got: {out!r}"
    return json.loads(out)


def is_num(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def test_throughput(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "throughput.png"
    r = run_json(capsys, throughput, ["--n", "3000", "--batch-size", "1000", "--repeats", "1", "--plot", str(png)])
    for key in ("traj_per_s", "baseline_traj_per_s", "ratio"):
        assert is_num(r[key]) and r[key] > 0, key
    assert r["processes"] == 2
    assert r["scored"] == r["ok"] == 3000
    assert r["all_scored"] is True
    assert set(r["goals"]) == {"ratio >= 0.8", "every trajectory scored"}
    assert png.stat().st_size > 0


def test_throughput_prices_bundling_against_the_bare_loop(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--n", "3000", "--batch-size", "1000", "--repeats", "1", "--bare-bundle", "16"]
    r = run_json(capsys, throughput, argv)
    assert r["bare_bundle"] == 16
    for key in ("bundled_traj_per_s", "bundled_over_baseline", "bundled_cpu_us_per_traj"):
        assert is_num(r[key]) and r[key] > 0, key
    assert len(r["runs_bundled_traj_per_s"]) == 1
    assert r["all_scored"] is True  # every side scored all 3,000, the bundled one included
    with pytest.raises(SystemExit, match="K >= 2"):
        throughput.main(["--n", "10", "--bare-bundle", "1", "--json"])


def test_per_sample(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "per_sample.png"
    argv = ["--n", "600", "--tasks", "64", "--batch-size", "300", "--repeats", "1", "--rate", "400"]
    r = run_json(
        capsys, per_sample, [*argv, "--latency-s", "0.5", "--profile", str(tmp_path / "p.out"), "--plot", str(png)]
    )
    for key in ("per_sample_samples_per_s", "batched_samples_per_s", "ratio", "trainer_cpu_us_per_sample"):
        assert is_num(r[key]) and r[key] > 0, key
    assert is_num(r["p50_ms"]) and 0 < r["p50_ms"] <= r["p99_ms"]
    assert r["all_ok"] is True and len(r["loadavg_at_start"]) == 3
    # The paced window's own collections only: the full one that clears the debt of the runs
    # before it comes before the window (and 200 samples are far from causing one).
    g0, g1, g2 = r["latency_gc_collections"]
    assert g0 >= 0 and g1 >= 0 and g2 == 0
    assert r["latency_all_cpu_us_per_sample"] > r["latency_trainer_cpu_us_per_sample"] > 0
    assert r["profile_top_us_per_sample"] and (tmp_path / "p.out").stat().st_size > 0
    assert set(r["goals"]) == {
        "ratio >= 0.8",
        "trainer CPU <= 60 us/sample",
        "p99 <= 20 ms at 400/s",
        "every sample scored ok",
    }
    assert png.stat().st_size > 0


def test_overlap(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "overlap.png"
    r = run_json(
        capsys,
        overlap,
        [
            "--batch",
            "32",
            "--group-size",
            "4",
            "--generation-s",
            "0.6",
            "--latency-median-s",
            "0.02",
            "--latency-p99-s",
            "0.05",
            "--rpm",
            "30000",
            "--plot",
            str(png),
        ],
    )
    for key in (
        "stream_step_s",
        "sync_step_s",
        "speedup",
        "ideal_step_s",
        "step_over_ideal",
        "reward_tail_s",
        "verifier_p99_s",
    ):
        assert is_num(r[key]) and r[key] > 0, key
    assert r["scored"] == r["batch"] == 32
    assert r["scores_match"] is True  # both modes scored the same samples alike
    assert r["stream_step_s"] >= r["last_finish_s"]  # no step ends before its last rollout
    assert png.stat().st_size > 0


def test_latency(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "latency.png"
    r = run_json(capsys, latency, ["--rate", "500", "--duration-s", "1", "--warmup-s", "0.2", "--plot", str(png)])
    for key in ("p50_ms", "p99_ms", "max_ms", "offered_per_s", "achieved_per_s"):
        assert is_num(r[key]) and r[key] > 0, key
    assert r["p50_ms"] <= r["p99_ms"] <= r["max_ms"]
    assert r["landed"] == r["samples"] > 0
    assert png.stat().st_size > 0


def test_latency_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert latency.main(["--rate", "200", "--duration-s", "0.5", "--warmup-s", "0"]) == 0
    out = capsys.readouterr().out
    assert "p50_ms" in out and "goal" in out
    with pytest.raises(json.JSONDecodeError):
        json.loads(out)


def test_memory(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    png = tmp_path / "memory.png"
    r = run_json(
        capsys,
        memory,
        ["--n", "6000", "--batch-size", "1000", "--max-backlog", "2000", "--sample-s", "0.05", "--plot", str(png)],
    )
    assert r["collected"] == r["n"] == 6000
    for key in (
        "worker_rss_10pct_bytes",
        "worker_rss_end_bytes",
        "server_used_memory_peak_bytes",
        "server_bound_bytes",
    ):
        assert isinstance(r[key], int) and r[key] > 0, key
    assert is_num(r["rss_growth"])
    assert png.stat().st_size > 0


def test_vs_verl(capsys: pytest.CaptureFixture[str]) -> None:
    if vs_verl.verl_status() is None:
        r = run_json(capsys, vs_verl, ["--n", "256", "--repeats", "1"])
        assert r["scores_agree"] == r["n"] == 256
        assert is_num(r["verl_samples_per_s"]) and is_num(r["stream_reward_samples_per_s"]) and is_num(r["ratio"])
    else:
        r = run_json(capsys, vs_verl, ["--n", "256"])
        assert list(r) == ["skipped"] and "verl" in r["skipped"]


def test_faults_bench_tiny_kills_workers_and_finds_nothing_lost_or_doubled(capsys):
    code = faults.main(
        ["--n", "400", "--workers", "2", "--kills", "2", "--kill-every-s", "0.1", "--reclaim-idle-ms", "300", "--json"]
    )
    report = json.loads(capsys.readouterr().out)
    assert code == 0
    assert report["n"] == 400 and report["kills"] == 2
    assert report["lost"] == 0 and report["duplicates"] == 0 and report["wrong_scores"] == 0
    assert report["scored"] == 400


def test_quota_bench_reports_the_achieved_rate_of_two_processes_sharing_one_quota(
    capsys: pytest.CaptureFixture[str],
) -> None:
    r = run_json(capsys, quota, ["--duration-s", "2", "--quota-rpm", "1200"])
    for key in ("quota_rpm", "achieved_rpm", "utilization", "http_429", "processes"):
        assert key in r
    assert r["processes"] == 2 and r["quota_rpm"] == 1200
    # Only sanity here (a busy test machine skews short runs); the bench itself targets >= 0.97.
    assert 0.3 < r["utilization"] <= 1.1


def test_composite_bench_compares_the_composite_with_one_function(capsys: pytest.CaptureFixture[str]) -> None:
    r = run_json(capsys, composite, ["--n", "40", "--concurrency", "8", "--judge-latency-ms", "5"])
    for key in ("composite_samples_per_s", "inline_samples_per_s", "inline_concurrent_samples_per_s", "ratio"):
        assert is_num(r[key]) and r[key] > 0, key
    assert r["inline_judge_requests"] == 40 and 0 < r["composite_judge_requests"] <= 40  # skip_unless spares some
    assert set(r["goals"]) == {"ratio >= 2"}


def test_math_verify_bench_scores_the_same_samples_through_the_pool_and_in_a_loop(capsys):
    r = run_json(capsys, math_verify, ["--n", "6", "--rounds", "2", "--processes", "2"])
    for key in ("pool_samples_per_s", "loop_samples_per_s", "ratio", "pool_cpu_ms_per_sample", "loop_cores_busy"):
        assert is_num(r[key]) and r[key] > 0, key
    assert (r["n"], r["rounds"], r["processes"]) == (6, 2, 2)
    assert r["scores_agree"] is True and r["right"] == 6  # every other sample right, both sides alike
    assert r["pool_timeouts"] == 0
    assert set(r["goals"]) == {"ratio >= 1.5", "scores agree", "composite ratio >= 2"}
    row = r["composite"]  # format + math-verify + judge, as components and as one function
    assert row["correct"] == "math-verify" and row["n"] == 6 and row["inline_judge_requests"] == 6
    assert is_num(row["ratio"]) and row["ratio"] > 0


def test_gateway(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ["--n", "512", "--request-size", "64", "--concurrency", "4", "--repeats", "1"]
    r = run_json(capsys, gateway, argv)
    for key in ("gateway_samples_per_s", "score_samples_per_s", "ratio", "bare_samples_per_s", "ratio_vs_bare"):
        assert is_num(r[key]) and r[key] > 0, key
    assert (r["n"], r["request_size"], r["concurrency"]) == (512, 64, 4)
    assert (
        len(r["runs_gateway_samples_per_s"])
        == len(r["runs_score_samples_per_s"])
        == len(r["runs_bare_samples_per_s"])
        == 1
    )
    assert r["all_answered"] is True
    assert set(r["goals"]) == {"ratio >= 0.8", "every sample answered"}


def test_sandbox_language_rows_say_their_shape_and_both_baselines() -> None:
    from stream_reward.bench.sandbox_languages import language_rows
    from stream_reward.scoring.sandbox.scorer import SandboxConfig, SandboxScorer

    try:
        scorer = SandboxScorer(SandboxConfig(concurrency=1, timeout_s=5.0, cpu_s=5.0))
    except Exception as exc:  # no sandbox backend on this host
        pytest.skip(str(exc))
    try:
        rows = language_rows(scorer, 1, programs=2, repeats=2, rounds=1, languages=("c", "javascript"))
    finally:
        scorer.close()
    for language, row in rows.items():
        if "missing" in row:
            continue
        shape = (row["programs"], row["repeats"], row["cases_per_program"], row["rounds"])
        assert shape == (2, 2, 4, 1) and row["cases"] == 16, language
        for key in ("cases_per_s", "bare_cases_per_s", "ratio", "compile_once_cases_per_s", "ratio_vs_compile_once"):
            assert is_num(row[key]) and row[key] > 0, (language, key)
        assert row["scores_as_expected"] is True
    if "missing" not in rows["c"]:
        assert rows["c"]["compile_s"] > 0 and rows["c"]["bare_compile_s"] > 0


def test_sandbox_bench_scores_every_problem_as_expected_with_its_rows_and_goals(capsys) -> None:
    from stream_reward.bench import sandbox

    r = run_json(capsys, sandbox, ["--n-problems", "20", "--rounds", "1", "--concurrency", "1", "--no-languages"])
    assert r["scores_as_expected"] is True and r["scores_agree_with_baseline"] is True
    assert set(r["single_case_by_form"]) == {"stdin", "call", "check", "assert"}
    assert r["long_cases"]["cases"] == 8  # two samples of four cases at concurrency 1
    for key in ("single_case_ratio", "multi_case_ratio"):
        assert is_num(r[key]) and r[key] > 0
    assert is_num(r["long_cases"]["ratio"]) and r["long_cases"]["ratio"] > 0
    assert set(r["goals"]) == {"single_case_ratio >= 2.0", "multi_case_ratio >= 1.5", "scores as expected"}
