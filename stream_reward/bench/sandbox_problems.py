"""The problems ``stream-reward bench sandbox`` scores: small real problems in the four
ground-truth forms, a correct and a broken solution each, and a few long-running
cases; as trajectories with the score each must get (1.0, or below it)."""

from __future__ import annotations

import json
from typing import Any

from stream_reward.wire.trajectory import Trajectory

__all__ = ["PROBLEMS", "first_case_only", "long_samples", "samples_of"]

# (ground truth, correct solution, broken solution)
PROBLEMS: list[tuple[dict[str, Any], str, str]] = [
    (
        {"inputs": ["1 2\n", "10 -3\n", "0 0\n"], "outputs": ["3\n", "7\n", "0\n"]},
        "a, b = map(int, input().split())\nprint(a + b)",
        "a, b = map(int, input().split())\nprint(a - b)",
    ),
    (
        {"inputs": ["abc\n", "racecar\n", "x\n"], "outputs": ["cba\n", "racecar\n", "x\n"]},
        "print(input()[::-1])",
        "print(input())",
    ),
    (
        {"inputs": ["3\n1 5 2\n", "1\n-4\n", "4\n7 7 1 9\n"], "outputs": ["5\n", "-4\n", "9\n"]},
        "input()\nprint(max(map(int, input().split())))",
        "input()\nprint(sorted(map(int, input().split()))[0])",
    ),
    (
        {"inputs": ["hello world\n", "xyz\n", "AEIOU\n"], "outputs": ["3\n", "0\n", "5\n"]},
        "print(sum(c in 'aeiouAEIOU' for c in input()))",
        "print(sum(c in 'aeiou' for c in input()))",
    ),
    (
        {"inputs": ["10\n", "1\n", "30\n"], "outputs": ["55\n", "1\n", "832040\n"]},
        "n = int(input())\na, b = 0, 1\nfor _ in range(n):\n    a, b = b, a + b\nprint(a)",
        "n = int(input())\nprint(n * (n + 1) // 2)",
    ),
    (
        {"inputs": ["5\n", "0\n", "20\n"], "outputs": ["120\n", "1\n", "146326063\n"]},
        "import math\nprint(math.factorial(int(input())) % (10**9 + 7))",
        "import math\nprint(math.factorial(int(input())))",
    ),
    (
        {"inputs": ["3 1 2\n", "5\n", "10 9 100\n"], "outputs": ["1 2 3\n", "5\n", "9 10 100\n"]},
        "print(*sorted(map(int, input().split())))",
        "print(*sorted(input().split()))",
    ),
    (
        {"inputs": ["level\n", "hello\n", "abca\n"], "outputs": ["YES\n", "NO\n", "NO\n"]},
        "s = input().strip()\nprint('YES' if s == s[::-1] else 'NO')",
        "s = input().strip()\nprint('YES' if s[0] == s[-1] else 'NO')",
    ),
    (
        {"inputs": ["12 18\n", "7 13\n", "100 75\n"], "outputs": ["6\n", "1\n", "25\n"]},
        "from math import gcd\na, b = map(int, input().split())\nprint(gcd(a, b))",
        "a, b = map(int, input().split())\nprint(min(a, b))",
    ),
    (
        {"inputs": ["7\n", "12\n", "97\n", "1\n"], "outputs": ["prime\n", "composite\n", "prime\n", "neither\n"]},
        "n = int(input())\nif n < 2:\n    print('neither')\nelif all(n % d for d in range(2, int(n**0.5) + 1)):\n    print('prime')\nelse:\n    print('composite')",
        "n = int(input())\nprint('prime' if n % 2 else 'composite')",
    ),
    (
        {"inputs": ["the cat the dog\n", "a\n", "x y x y x\n"], "outputs": ["the 2\n", "a 1\n", "x 3\n"]},
        "from collections import Counter\nw, c = Counter(input().split()).most_common(1)[0]\nprint(w, c)",
        "words = input().split()\nprint(words[0], len(words))",
    ),
    (
        {"inputs": ["2 3\n1 2 3\n4 5 6\n", "1 1\n9\n"], "outputs": ["1 4\n2 5\n3 6\n", "9\n"]},
        "r, c = map(int, input().split())\nm = [input().split() for _ in range(r)]\nfor col in zip(*m):\n    print(*col)",
        "r, c = map(int, input().split())\nm = [input().split() for _ in range(r)]\nfor row in m:\n    print(*row)\nraise SystemExit(1)",
    ),
    (
        {"fn_name": "add", "inputs": [[1, 2], [-5, 5], [100, 23]], "outputs": [3, 0, 123]},
        "def add(a, b):\n    return a + b",
        "def add(a, b):\n    return a * b",
    ),
    (
        {"fn_name": "twoSum", "inputs": [[[2, 7, 11, 15], 9], [[3, 2, 4], 6]], "outputs": [[0, 1], [1, 2]]},
        "class Solution:\n    def twoSum(self, nums, target):\n        seen = {}\n        for i, x in enumerate(nums):\n            if target - x in seen:\n                return [seen[target - x], i]\n            seen[x] = i",
        "class Solution:\n    def twoSum(self, nums, target):\n        return [0, len(nums) - 1]",
    ),
    (
        {
            "fn_name": "is_anagram",
            "inputs": [["listen", "silent"], ["ab", "abc"], ["rat", "car"]],
            "outputs": [True, False, False],
        },
        "def is_anagram(a, b):\n    return sorted(a) == sorted(b)",
        "def is_anagram(a, b):\n    return set(a) <= set(b)",
    ),
    (
        {"fn_name": "flatten", "inputs": [[[[1, [2, 3]], 4]], [[[]]], [[[[5]]]]], "outputs": [[1, 2, 3, 4], [], [5]]},
        "def flatten(xs):\n    out = []\n    for x in xs:\n        out.extend(flatten(x) if isinstance(x, list) else [x])\n    return out",
        "def flatten(xs):\n    return xs[0]",
    ),
    (
        {"assert_case": ["assert square(3) == 9", "assert square(-2) == 4", "assert square(0) == 0"]},
        "def square(x):\n    return x * x",
        "def square(x):\n    return x + x",
    ),
    (
        {"assert_case": ["assert max3(1, 2, 3) == 3", "assert max3(9, 2, 3) == 9", "assert max3(-1, -2, -3) == -1"]},
        "def max3(a, b, c):\n    return max(a, b, c)",
        "def max3(a, b, c):\n    return c",
    ),
    (
        {
            "test": "def check(candidate):\n    assert candidate([1.0, 2.0, 3.0], 0.5) is False\n    assert candidate([1.0, 2.8, 3.0, 4.0, 5.0, 2.0], 0.3) is True\n",
            "entry_point": "has_close_elements",
        },
        "def has_close_elements(numbers, threshold):\n    s = sorted(numbers)\n    return any(b - a < threshold for a, b in zip(s, s[1:]))",
        "def has_close_elements(numbers, threshold):\n    return False",
    ),
    (
        {
            "test": "def check(candidate):\n    assert candidate([1, 2, -4, 5]) is True\n    assert candidate([1, 2, 3]) is False\n",
            "entry_point": "below_zero",
        },
        "def below_zero(ops):\n    total = 0\n    for op in ops:\n        total += op\n        if total < 0:\n            return True\n    return False",
        "def below_zero(ops):\n    return sum(ops) < 0",
    ),
]


def samples_of(n_problems: int) -> list[tuple[Trajectory, float]]:
    """(trajectory, expected score) for a correct and a broken solution per problem."""
    out = []
    for i in range(n_problems):
        gt, good, bad = PROBLEMS[i % len(PROBLEMS)]
        for j, code in enumerate((good, bad)):
            traj = Trajectory(
                batch_id="bench",
                index=2 * i + j,
                data_source="code",
                response=f"Here:\n```python\n{code}\n```\n",
                ground_truth=json.dumps(gt),
            )
            out.append((traj, 1.0 if j == 0 else -1.0))  # broken: any score < 1
    return out


def long_samples(copies: int) -> list[tuple[Trajectory, float]]:
    """Right answers whose cases compute for ~20 ms each: the warm start saves less
    here, and any fixed cost a case pays in the sandbox shows (moving each case into
    its cgroups once waited ~10 ms for an RCU grace period)."""
    program = "n = int(input())\nprint(sum(i * i % 7 for i in range(n)))"
    inputs = [150_000, 160_000, 170_000, 180_000]
    gt = {"inputs": [f"{n}\n" for n in inputs], "outputs": [f"{sum(i * i % 7 for i in range(n))}\n" for n in inputs]}
    traj = Trajectory(
        batch_id="bench",
        index=0,
        data_source="code",
        response=f"```python\n{program}\n```",
        ground_truth=json.dumps(gt),
    )
    return [(traj, 1.0)] * copies


def first_case_only(samples: list[tuple[Trajectory, float]]) -> list[tuple[Trajectory, float]]:
    out = []
    for traj, expected in samples:
        gt = json.loads(traj.ground_truth)
        for key in ("inputs", "outputs", "assert_case"):
            if key in gt:
                gt[key] = gt[key][:1]
        out.append(
            (
                Trajectory(
                    batch_id=traj.batch_id,
                    index=traj.index,
                    data_source=traj.data_source,
                    response=traj.response,
                    ground_truth=json.dumps(gt),
                ),
                expected,
            )
        )
    return out
