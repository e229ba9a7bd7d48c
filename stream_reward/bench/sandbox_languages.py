"""Per-language rows of ``stream-reward bench sandbox``: test cases per second
through the sandbox (a GRPO group of identical answers: one compile, then every
case) divided by compiling and running the same programs bare (plain
subprocesses, same parallelism, same commands), in the same run."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import tempfile
import time
from typing import Any

from stream_reward.errors import VerifierError
from stream_reward.scoring.sandbox.compiled import Artifact, build_for, compile_job, run_job
from stream_reward.scoring.sandbox.scorer import SandboxScorer
from stream_reward.wire.trajectory import Trajectory

__all__ = ["language_rows"]

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


def _bare(scorer: SandboxScorer, language: str, group: int, concurrency: int) -> tuple[float, float, bool]:
    """Compile once and run every case of ``group`` samples as plain subprocesses:
    (compile seconds, total seconds, all outputs right)."""
    toolchain = scorer.toolchain(language)
    source = SUM[language]
    build = build_for(toolchain, source, scorer.config.memory_mb)
    start = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="stream-reward-bench-") as tmp:
        artifact = None
        if build.steps:
            job = compile_job(build, source)
            for name, data, _ in job["files"]:
                with open(os.path.join(tmp, name), "wb") as f:
                    f.write(data)
            os.mkdir(os.path.join(tmp, "out"))
            for argv in build.steps:
                subprocess.run(argv, cwd=tmp, env=build.env, check=True, capture_output=True, timeout=120)
            out = os.path.join(tmp, "out")
            files = {}
            for name in os.listdir(out):
                with open(os.path.join(out, name), "rb") as built:
                    files[name] = built.read()
            artifact = Artifact(True, files)
        compile_s = time.monotonic() - start
        run_dir = os.path.join(tmp, "run")
        os.mkdir(run_dir)
        for name, data, mode in run_job(build, source, artifact)["files"]:
            path = os.path.join(run_dir, name)
            with open(path, "wb") as f:
                f.write(data)
            os.chmod(path, mode)

        async def case(stdin: str, expected: str) -> bool:
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

        async def every() -> bool:
            sem = asyncio.Semaphore(concurrency)

            async def one(stdin: str, expected: str) -> bool:
                async with sem:
                    return await case(stdin, expected)

            pairs = list(zip(TESTS["inputs"], TESTS["outputs"], strict=True)) * group
            return all(await asyncio.gather(*(one(i, o) for i, o in pairs)))

        ok = asyncio.run(every())
    return compile_s, time.monotonic() - start, ok


def _sandboxed(scorer: SandboxScorer, language: str, group: int, salt: str) -> tuple[float, float, bool]:
    """The same group through the scorer, a fresh source (``salt``) so that it compiles once."""
    comment = "//"
    response = f"```{language}\n{SUM[language]}\n{comment} {salt}\n```"
    traj = Trajectory(batch_id="b", index=0, data_source="code", response=response, ground_truth=json.dumps(TESTS))

    async def go() -> list[Any]:
        return list(await asyncio.gather(*(scorer.score(traj) for _ in range(group))))

    start = time.monotonic()
    scored = asyncio.run(go())
    compile_s = max(float(s.extra.get("compile_s", 0.0)) for s in scored)
    return compile_s, time.monotonic() - start, all(s.score == 1.0 for s in scored)


def language_rows(scorer: SandboxScorer, concurrency: int, group: int = 8) -> dict[str, dict[str, Any]]:
    """A row per language: cases/s sandboxed and bare, their ratio, compile seconds."""
    rows: dict[str, dict[str, Any]] = {}
    cases = len(TESTS["inputs"]) * group
    for language in SUM:
        try:
            scorer.toolchain(language)
        except VerifierError as exc:
            rows[language] = {"missing": str(exc)}
            continue
        compile_s, sandbox_s, ok = _sandboxed(scorer, language, group, f"bench {time.time_ns()}")
        bare_compile_s, bare_s, bare_ok = _bare(scorer, language, group, concurrency)
        rows[language] = {
            "cases": cases,
            "cases_per_s": round(cases / sandbox_s, 1),
            "bare_cases_per_s": round(cases / bare_s, 1),
            "ratio": round(bare_s / sandbox_s, 3),
            "compile_s": round(compile_s, 3),
            "bare_compile_s": round(bare_compile_s, 3),
            "scores_as_expected": ok and bare_ok,
        }
    return rows
