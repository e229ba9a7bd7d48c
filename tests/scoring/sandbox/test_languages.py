"""Programs in C, C++, Java, JavaScript, Go and Rust: the block choice, the compile
cache, and the outcomes of the stdin form, with real compilers in real sandboxes.

A language's tests skip when its toolchain is missing here, unless
STREAM_REWARD_REQUIRE_TOOLCHAINS is set (CI): then they fail."""

from __future__ import annotations

import asyncio
import json
import os
import re
import subprocess
from collections.abc import Iterator
from typing import Any

import pytest
from sandbox_support import UIDS, scorer_or_skip
from sandbox_table import PROGRAMS, SUM

from stream_reward.errors import VerifierError
from stream_reward.scoring.sandbox.compiled import Artifact, CompileCache, java_class, java_unpackaged
from stream_reward.scoring.sandbox.languages import choose_program, task_language
from stream_reward.scoring.sandbox.scorer import SandboxScorer
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.trajectory import Trajectory

BROKEN = {
    "cpp": "int main() { return undefined_name; }",
    "c": "int main(void) { return undefined_name; }",
    "java": "public class Main { public static void main(String[] a) { undefinedName(); } }",
    "go": "package main\n\nfunc main() { undefinedName() }",
    "rust": "fn main() { undefined_name(); }",
}
COMPILED = sorted(BROKEN)


def program(language: str, op: str = "+", salt: str = "") -> str:
    code = PROGRAMS[language].replace("OP", op)
    comment = "#" if language == "python" else "//"
    return f"{code}\n{comment} {salt}\n" if salt else code


@pytest.fixture(scope="module")
def polyglot() -> Iterator[SandboxScorer]:
    # Compilers need room: a 1 GiB slot, and per-case time for a JVM's start on a loaded host.
    s = scorer_or_skip(dict(timeout_s=4.0, cpu_s=4.0, memory_mb=1024, max_output_bytes=1 << 20, **UIDS))
    yield s
    s.close()


def needs(scorer: SandboxScorer, language: str) -> None:
    try:
        scorer.toolchain(language)
    except VerifierError as exc:
        if os.environ.get("STREAM_REWARD_REQUIRE_TOOLCHAINS"):
            raise
        pytest.skip(str(exc))


def sample(response: str, ground_truth: dict[str, Any] = SUM, **extra_info: Any) -> Trajectory:
    return Trajectory(
        batch_id="b",
        index=0,
        data_source="code",
        response=response,
        ground_truth=json.dumps(ground_truth),
        extra_info=extra_info,
    )


def fenced(language: str, code: str, fence: str = "```") -> str:
    return f"Here is my solution.\n{fence}{language}\n{code}\n{fence}\n"


def score(scorer: SandboxScorer, traj: Trajectory) -> Scored:
    return asyncio.run(scorer.score(traj))


@pytest.mark.parametrize("language", sorted(PROGRAMS))
def test_a_correct_program_scores_one_and_a_wrong_one_zero(polyglot: SandboxScorer, language: str) -> None:
    needs(polyglot, language)
    right = score(polyglot, sample(fenced(language, program(language, "+"))))
    assert (right.score, right.extra["cases"], right.extra["language"]) == (1.0, ["passed", "passed"], language)
    wrong = score(polyglot, sample(fenced(language, program(language, "-"))))
    assert (wrong.score, wrong.extra["cases"]) == (0.0, ["failed", "failed"])
    assert "reason" not in wrong.extra


@pytest.mark.parametrize("language", COMPILED)
def test_a_compile_error_scores_zero_and_names_compile_error(polyglot: SandboxScorer, language: str) -> None:
    needs(polyglot, language)
    scored = score(polyglot, sample(fenced(language, BROKEN[language])))
    assert scored.score == 0.0
    assert scored.extra["reason"] == "compile_error"
    assert "undefined" in scored.extra["compile_error"].lower()
    assert scored.extra["error"].startswith("case 0: failed: compile error")


def test_a_runtime_error_scores_zero_for_its_case(polyglot: SandboxScorer) -> None:
    needs(polyglot, "rust")
    code = 'fn main() { let v: Vec<i64> = Vec::new(); println!("{}", v[3]); }'
    scored = score(polyglot, sample(fenced("rust", code)))
    assert (scored.score, scored.extra["cases"]) == (0.0, ["runtime_error", "runtime_error"])


def test_a_missing_toolchain_fails_the_sample_naming_it() -> None:
    s = scorer_or_skip(dict(memory_mb=1024, **UIDS), toolchain_path="")
    try:
        with pytest.raises(VerifierError, match="g\\+\\+") as err:
            score(s, sample(fenced("cpp", program("cpp"))))
        assert err.value.reason == "toolchain_missing"
        assert score(s, sample(fenced("python", "print(sum(map(int, input().split())))"))).score == 1.0
    finally:
        s.close()


def test_a_repeated_program_compiles_once(polyglot: SandboxScorer) -> None:
    needs(polyglot, "cpp")
    code = program("cpp", salt="compiled once")
    before = polyglot.compile_cache.compiles

    async def group() -> list[Scored]:
        # A GRPO group: the same answer n times, scored concurrently, then once more.
        first = await asyncio.gather(*(polyglot.score(sample(fenced("cpp", code))) for _ in range(3)))
        return [*first, await polyglot.score(sample(fenced("cpp", code)))]

    scored = asyncio.run(group())
    assert [s.score for s in scored] == [1.0] * 4
    assert polyglot.compile_cache.compiles - before == 1
    assert sorted(s.extra["compile"] for s in scored) == ["cached", "cached", "cached", "compiled"]


def test_a_program_that_loops_forever_times_out_and_scores_zero(polyglot: SandboxScorer) -> None:
    needs(polyglot, "cpp")
    scored = score(polyglot, sample(fenced("cpp", "int main() { volatile long i = 0; for (;;) i++; }")))
    assert (scored.score, scored.extra["cases"]) == (0.0, ["timeout", "timeout"])


def test_tilde_fences_are_code_blocks(polyglot: SandboxScorer) -> None:
    needs(polyglot, "go")
    assert score(polyglot, sample(fenced("go", program("go"), fence="~~~"))).score == 1.0


def test_the_task_language_chooses_the_block(polyglot: SandboxScorer) -> None:
    needs(polyglot, "c")
    response = fenced("c", program("c")) + "Or in Python:\n" + fenced("python", "print('no')")
    assert score(polyglot, sample(response, {**SUM, "language": "c"})).score == 1.0
    assert score(polyglot, sample(response, language="C")).score == 1.0
    assert score(polyglot, sample(response)).score == 0.0  # no task language: the Python block


def test_block_choice_rule() -> None:
    blocks = "```cpp\nA\n```\n```python\nB\n```\n~~~cpp\nC\n~~~\n```cpp\n\n```\n"
    assert choose_program(blocks, "cpp") == ("cpp", "C\n")  # the last non-empty block of the language
    assert choose_program(blocks, None) == ("python", "B\n")  # no task language: Python first
    assert choose_program(blocks, "java") == ("java", "C\n")  # none of the language: the last block
    assert choose_program("```rs\nR\n```", None) == ("rust", "R\n")  # its tag names the language
    assert choose_program("```\nU\n```", None) == ("python", "U\n")
    assert choose_program("~~~\n```js\nX\n```\n~~~", None) == (
        "python",
        "```js\nX\n```\n",
    )  # a fence closes its own kind
    assert choose_program("no code", "cpp") is None
    assert task_language(json.dumps({**SUM, "language": "C++"}), {}) == "cpp"
    assert task_language(json.dumps(SUM), {"language": "golang"}) == "go"
    assert task_language(json.dumps(SUM), {}) is None


def test_the_java_class_is_the_public_one_or_main() -> None:
    assert java_class("class A {}\npublic final class Sol { public static void main(String[] a) {} }") == "Sol"
    assert java_class("class Main { public static void main(String[] a) {} }") == "Main"
    assert java_class("class Helper {}\nclass Runner { public static void main(String[] a) {} }") == "Runner"


def test_the_java_class_ignores_comments_literals_and_nested_classes() -> None:
    main = "public static void main(String[] a) {}"
    assert java_class(f"// on Codeforces: public class Main\npublic class Solution {{ {main} }}") == "Solution"
    assert java_class(f'public class Solution {{ String s = "public class X"; {main} }}') == "Solution"
    assert java_class(f"public class Solution {{ public static class Pair {{ }} {main} }}") == "Solution"
    assert java_class(f"class Solution {{ static class Reader {{ }} {main} }}") == "Solution"


def test_only_the_leading_java_package_declaration_is_blanked_keeping_line_numbers() -> None:
    source = '// x\npackage a.b;\nclass M { String s = "package c;"; }\npackage d;'
    assert (
        java_unpackaged(source)
        == "// x\n" + " " * len("package a.b;") + '\nclass M { String s = "package c;"; }\npackage d;'
    )
    assert java_unpackaged("class M { }") == "class M { }"


def test_the_compile_cache_evicts_the_least_recently_used(tmp_path: Any) -> None:
    cache = CompileCache(str(tmp_path), max_mb=1)
    blob = b"x" * (400 << 10)
    for key in ("a", "b"):
        cache.put(key, Artifact(True, {"main": blob}))
    os.utime(tmp_path / "a" / "meta.json", (1, 1))
    os.utime(tmp_path / "b" / "meta.json", (2, 2))
    assert cache.get("a") is not None  # used: now the newest
    cache.put("c", Artifact(True, {"main": blob}))
    assert (cache.get("a") is not None, cache.get("b") is None, cache.get("c") is not None) == (True, True, True)


JAVA_SUM_BODY = (
    "  public static void main(String[] x) {\n    java.util.Scanner s = new java.util.Scanner(System.in);\n"
    "    long a = s.nextLong(), b = s.nextLong();\n    System.out.println(a OP b);\n  }\n"
)


@pytest.mark.parametrize(
    "head",
    [
        "package solution;\n\npublic class Solution {\n",
        "package com.example.judge;\nimport java.util.*;\n\npublic final class Answer {\n",
        "/* a header */ package p;\nclass Runner {\n",
    ],
)
def test_a_java_program_in_a_package_runs(polyglot: SandboxScorer, head: str) -> None:
    needs(polyglot, "java")
    right = score(polyglot, sample(fenced("java", head + JAVA_SUM_BODY.replace("OP", "+") + "}\n")))
    assert (right.score, right.extra["cases"]) == (1.0, ["passed", "passed"]), right.extra
    wrong = score(polyglot, sample(fenced("java", head + JAVA_SUM_BODY.replace("OP", "-") + "}\n")))
    assert (wrong.score, wrong.extra["cases"]) == (0.0, ["failed", "failed"])


def test_a_java_program_whose_main_class_is_not_public_and_not_main_runs(polyglot: SandboxScorer) -> None:
    needs(polyglot, "java")
    code = (
        "class Helper { static long add(long a, long b) { return a + b; } }\nclass Solver {\n"
        + JAVA_SUM_BODY.replace("a OP b", "Helper.add(a, b)")
        + "}\n"
    )
    assert score(polyglot, sample(fenced("java", code))).score == 1.0


def test_a_go_program_with_generics_runs_on_the_installed_toolchain(polyglot: SandboxScorer) -> None:
    needs(polyglot, "go")
    code = (
        'package main\n\nimport "fmt"\n\ntype Number interface{ ~int | ~int64 }\n\n'
        "func Sum[T Number](xs ...T) T {\n\tvar t T\n\tfor _, x := range xs {\n\t\tt += x\n\t}\n\treturn t\n}\n\n"
        "func main() {\n\tvar a, b int\n\tfmt.Scan(&a, &b)\n\tfmt.Println(Sum(a, b))\n}\n"
    )
    assert score(polyglot, sample(fenced("go", code))).score == 1.0


def test_a_go_builtin_newer_than_the_toolchain_is_the_programs_compile_error(polyglot: SandboxScorer) -> None:
    # min/max are builtins from Go 1.21: on an older toolchain the program does not
    # compile, which is the policy's loss (0, status ok), never a failed sample.
    needs(polyglot, "go")
    code = 'package main\n\nimport "fmt"\n\nfunc main() {\n\tvar a, b int\n\tfmt.Scan(&a, &b)\n\tfmt.Println(min(a, b) + max(a, b))\n}\n'
    scored = score(polyglot, sample(fenced("go", code)))
    if _go_minor(polyglot) >= 21:
        assert scored.score == 1.0
    else:
        assert (scored.score, scored.extra["reason"]) == (0.0, "compile_error")
        assert "min" in scored.extra["compile_error"]


def _go_minor(scorer: SandboxScorer) -> int:
    banner = subprocess.run([scorer.toolchain("go").tools["go"], "version"], capture_output=True, text=True).stdout
    found = re.search(r"go1\.(\d+)", banner)
    assert found, banner
    return int(found.group(1))


def test_programs_taking_turns_on_one_slot_each_run_their_own_artifact(polyglot: SandboxScorer) -> None:
    # Samples one after another reuse the warm slot, and its harness keeps the last
    # program's files between cases: a different program must never run the kept one.
    needs(polyglot, "c")
    for language in ("c", "rust", "c"):
        needs(polyglot, language)
        right = score(polyglot, sample(fenced(language, program(language, "+", salt="turns"))))
        wrong = score(polyglot, sample(fenced(language, program(language, "-", salt="turns"))))
        assert (right.score, wrong.score) == (1.0, 0.0), language


def test_a_case_that_deletes_or_overwrites_its_binary_leaves_the_next_case_intact(polyglot: SandboxScorer) -> None:
    needs(polyglot, "c")
    code = (
        '#include <stdio.h>\nint main(int n, char **argv){long a,b;scanf("%ld %ld",&a,&b);'
        'FILE *f=fopen(argv[0],"w");if(f){fputs("garbage",f);fclose(f);}remove(argv[0]);'
        'printf("%ld\\n",a+b);return 0;}'
    )
    for _ in range(2):  # the second sample of the same program: its files were kept
        scored = score(polyglot, sample(fenced("c", code)))
        assert (scored.score, scored.extra["cases"]) == (1.0, ["passed", "passed"])


@pytest.mark.parametrize("language", ["javascript", "go"])
def test_a_runtime_that_reserves_address_space_runs_under_a_small_memory_limit(language: str) -> None:
    """Node and Go reserve ~700 MiB of address space before main: under a 256 MiB
    limit a right program must still pass, and a wrong one still fail."""
    s = scorer_or_skip(dict(timeout_s=4.0, cpu_s=4.0, memory_mb=256, **UIDS))
    try:
        needs(s, language)
        assert score(s, sample(fenced(language, program(language, "+")))).score == 1.0
        assert score(s, sample(fenced(language, program(language, "-")))).score == 0.0
    finally:
        s.close()
