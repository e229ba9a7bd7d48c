"""Per-language rows of ``stream-reward bench sandbox``: test cases per second
through the sandbox divided by compiling and running the same samples bare, in
the same run.

The shape is an RL batch of repeated programs: ``programs`` distinct programs,
each answered ``repeats`` times identically (a GRPO group), each sample run on
``cases`` test cases. The sandbox scores every sample (concurrently, its
``concurrency`` slots): one compile per distinct program, the rest are cache
hits. The baseline is a naive verifier with the same parallelism and the same
commands as plain subprocesses: per sample, compile into a fresh directory and
run each case (``ratio``, the goal >= 1.0). ``ratio_vs_compile_once`` prices the
sandbox against a bare verifier that also compiles each distinct program only
once: the per-case cost of the isolation alone. Rounds alternate which side
goes first, so background load hits both alike; every sandbox round compiles
afresh (its programs are salted anew)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
from typing import Any

from stream_reward.errors import VerifierError
from stream_reward.scoring.sandbox.compiled import Build, build_for, compile_job
from stream_reward.scoring.sandbox.scorer import SandboxScorer
from stream_reward.wire.trajectory import Trajectory

__all__ = ["language_rows", "SUM", "TESTS"]

TESTS = {"inputs": ["1 2\n", "10 -3\n", "0 0\n", "7 8\n"], "outputs": ["3\n", "7\n", "0\n", "15\n"]}
SUM = {
    "cpp": '#include <iostream>\nint main(){long a,b;std::cin>>a>>b;std::cout<<a+b<<"\\n";}',
    "c": '#include <stdio.h>\nint main(void){long a,b;scanf("%ld %ld",&a,&b);printf("%ld\\n",a+b);return 0;}',
    "java": "import java.util.*;\npublic class Main{public static void main(String[] x){"
    "Scanner s=new Scanner(System.in);System.out.println(s.nextLong()+s.nextLong());}}",
    "javascript": 'const [a,b]=require("fs").readFileSync(0,"utf8").trim().split(/\\s+/).map(Number);console.log(a+b);',
    "go": 'package main\nimport "fmt"\nfunc main(){var a,b int;fmt.Scan(&a,&b);fmt.Println(a+b)}',
    "rust": "use std::io::Read;\nfn main(){let mut s=String::new();std::io::stdin().read_to_string(&mut s).unwrap();"
    'let v:Vec<i64>=s.split_whitespace().map(|x|x.parse().unwrap()).collect();println!("{}",v[0]+v[1]);}',
}


def _sources(language: str, programs: int, salt: str) -> list[str]:
    """``programs`` distinct sources (every language here takes ``//`` comments)."""
    return [f"{SUM[language]}\n// {salt} program {p}\n" for p in range(programs)]


def _bare_compile(build: Build, source: str, where: str, shared_tmp: str) -> str:
    """Compile ``source`` in ``where`` with the sandbox's commands; the directory to run in."""
    for name, data, _ in compile_job(build, source)["files"]:
        with open(os.path.join(where, name), "wb") as f:
            f.write(data)
    out = os.path.join(where, "out")
    os.mkdir(out)
    # The host's own temporary directory and Go build cache, kept across compiles as a
    # long-running verifier's would be (the sandbox's are fresh per compile).
    env = {**build.env, "TMPDIR": shared_tmp}
    if "GOCACHE" in env:
        env.update(GOCACHE=os.path.join(shared_tmp, "gocache"), GOPATH=os.path.join(shared_tmp, "gopath"))
    for argv in build.steps:
        subprocess.run(argv, cwd=where, env=env, check=True, capture_output=True, timeout=120)
    return out


async def _bare_case(build: Build, run_dir: str, stdin: str, expected: str) -> bool:
    proc = await asyncio.create_subprocess_exec(
        *build.run_argv,
        cwd=run_dir,
        env=build.run_env,
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        stderr=subprocess.DEVNULL,
    )
    out, _ = await proc.communicate(stdin.encode())
    return out.decode().split() == expected.split()


def _bare(
    scorer: SandboxScorer, language: str, sources: list[str], repeats: int, concurrency: int, compile_once: bool
) -> tuple[float, float, bool]:
    """Every sample as plain subprocesses, ``concurrency`` samples at a time: (compile
    seconds summed, wall seconds, all outputs right). ``compile_once``: each distinct
    source is compiled by its first sample only."""
    toolchain = scorer.toolchain(language)
    builds = [build_for(toolchain, s, scorer.config.memory_mb) for s in sources]
    cases = list(zip(TESTS["inputs"], TESTS["outputs"], strict=True))
    compile_s = 0.0

    async def every(tmp: str) -> bool:
        sem = asyncio.Semaphore(concurrency)
        compiled: dict[int, asyncio.Task[str]] = {}

        def compile_(p: int, sample: int) -> str:
            nonlocal compile_s
            start = time.monotonic()
            where = os.path.join(tmp, f"p{p}-s{sample}")
            os.mkdir(where)
            if not builds[p].steps:  # interpreted: the source is the program
                for name, data, _ in compile_job(builds[p], sources[p])["files"]:
                    with open(os.path.join(where, name), "wb") as f:
                        f.write(data)
                return where
            out = _bare_compile(builds[p], sources[p], where, tmp)
            compile_s += time.monotonic() - start
            return out

        async def sample(p: int, i: int) -> bool:
            async with sem:
                if compile_once:
                    if p not in compiled:
                        compiled[p] = asyncio.ensure_future(asyncio.to_thread(compile_, p, i))
                    run_dir = await compiled[p]
                else:
                    run_dir = await asyncio.to_thread(compile_, p, i)
                return all([await _bare_case(builds[p], run_dir, i_, o) for i_, o in cases])

        jobs = [sample(p, i) for i in range(repeats) for p in range(len(sources))]
        return all(await asyncio.gather(*jobs))

    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stream-reward-bench-") as tmp:
        ok = asyncio.run(every(tmp))
    return compile_s, time.monotonic() - start, ok


def _sandboxed(scorer: SandboxScorer, language: str, sources: list[str], repeats: int) -> tuple[float, float, bool]:
    """The same samples through the scorer: (compile seconds summed, wall seconds, all scored 1.0)."""
    trajs = [
        Trajectory(
            batch_id="b",
            index=0,
            data_source="code",
            response=f"```{language}\n{source}```",
            ground_truth=json.dumps(TESTS),
        )
        for _ in range(repeats)
        for source in sources
    ]

    async def go() -> list[Any]:
        return list(await asyncio.gather(*(scorer.score(t) for t in trajs)))

    start = time.monotonic()
    scored = asyncio.run(go())
    wall = time.monotonic() - start
    compile_s = sum(float(s.extra.get("compile_s", 0.0)) for s in scored if s.extra.get("compile") == "compiled")
    return compile_s, wall, all(s.score == 1.0 for s in scored)


def language_rows(
    scorer: SandboxScorer,
    concurrency: int,
    programs: int = 2,
    repeats: int = 4,
    rounds: int = 2,
    languages: tuple[str, ...] = tuple(SUM),
) -> dict[str, dict[str, Any]]:
    """A row per language: cases/s sandboxed and bare (naive and compile-once), their
    ratios, compile seconds; totals over ``rounds``."""
    rows: dict[str, dict[str, Any]] = {}
    cases = len(TESTS["inputs"]) * programs * repeats
    for language in languages:
        try:
            scorer.toolchain(language)
        except VerifierError as exc:
            rows[language] = {"missing": str(exc)}
            continue
        t = {"sandbox": 0.0, "bare": 0.0, "once": 0.0, "sandbox_compile": 0.0, "bare_compile": 0.0}
        ok = True
        for r in range(rounds):
            sources = _sources(language, programs, f"bench {time.time_ns()}")
            sides = ["sandbox", "bare", "once"]
            for side in sides if r % 2 == 0 else sides[::-1]:
                if side == "sandbox":
                    compile_s, wall, good = _sandboxed(scorer, language, sources, repeats)
                    t["sandbox_compile"] += compile_s
                else:
                    compile_s, wall, good = _bare(scorer, language, sources, repeats, concurrency, side == "once")
                    if side == "bare":
                        t["bare_compile"] += compile_s
                t[side] += wall
                ok = ok and good
        rows[language] = {
            "programs": programs,
            "repeats": repeats,
            "cases_per_program": len(TESTS["inputs"]),
            "cases": cases,
            "rounds": rounds,
            "cases_per_s": round(cases * rounds / t["sandbox"], 1),
            "bare_cases_per_s": round(cases * rounds / t["bare"], 1),
            "ratio": round(t["bare"] / t["sandbox"], 3),
            "compile_once_cases_per_s": round(cases * rounds / t["once"], 1),
            "ratio_vs_compile_once": round(t["once"] / t["sandbox"], 3),
            "compile_s": round(t["sandbox_compile"] / rounds, 3),
            "bare_compile_s": round(t["bare_compile"] / rounds, 3),
            "scores_as_expected": ok,
        }
    return rows
