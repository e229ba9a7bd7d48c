"""What every bench shares: flags, output (one JSON object or a table), a progress
bar, plots, and the local pipeline pieces (private server, worker processes).

Output discipline: with ``--json`` stdout carries exactly one JSON object and
nothing else; progress and logs go to stderr, and only when stderr is a terminal
and ``--json`` is not given.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import math
import os
import random
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

__all__ = [
    "bench_parser",
    "emit",
    "Progress",
    "percentile",
    "rss_bytes",
    "cpu_seconds",
    "wait_for_workers",
    "stop_procs",
    "Workers",
    "gsm8k_pool",
    "say",
    "plot_unavailable",
    "plot_figure",
    "save_figure",
    "bench_main",
    "quiet_server",
    "add_torch_threads",
    "setup_torch",
    "GcWatch",
    "child_env",
    "REPO_ROOT",
]


_CONTEXT: dict[str, Any] = {}


def bench_parser(name: str, description: str) -> argparse.ArgumentParser:
    # Other load on the machine when the bench started: the numbers are only
    # comparable within one run (each bench measures its baseline alongside).
    _CONTEXT["host_loadavg_1m_at_start"] = round(os.getloadavg()[0], 2)
    parser = argparse.ArgumentParser(prog=f"stream-reward bench {name}", description=description)
    parser.add_argument("--json", action="store_true", help="print one JSON object on stdout, nothing else")
    parser.add_argument("--plot", metavar="FILE.png", default=None, help="save a plot (needs matplotlib)")
    parser.add_argument("--seed", type=int, default=0)
    return parser


def add_torch_threads(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--torch-threads",
        type=int,
        default=1,
        help="intra-op threads of torch in this (trainer-side) process; 0 keeps torch's default. "
        "One by default: on a small machine shared with the workers and the server, OpenMP "
        "threads spinning after each rm_scores fill take CPU from them",
    )


def setup_torch(args: argparse.Namespace) -> None:
    """Import torch (as a trainer would have it loaded) and apply --torch-threads."""
    from stream_reward.trainer.tensors import import_torch

    torch = import_torch("the benchmarks")

    if getattr(args, "torch_threads", 0):
        torch.set_num_threads(args.torch_threads)


def interactive(args: argparse.Namespace) -> bool:
    return not args.json and sys.stderr.isatty()


def say(args: argparse.Namespace, message: str) -> None:
    """A log line for a person watching: stderr, TTY only, never under --json."""
    if interactive(args):
        print(message, file=sys.stderr, flush=True)


# ---------------------------------------------------------------------- output
def _fmt(value: Any) -> str:
    if isinstance(value, bool) or value is None:
        return str(value)
    if isinstance(value, float):
        if value == 0 or 0.01 <= abs(value) < 1e6:
            return f"{value:,.3f}".rstrip("0").rstrip(".") if abs(value) < 100 else f"{value:,.1f}"
        return f"{value:.3g}"
    if isinstance(value, int):
        return f"{value:,}"
    if isinstance(value, (dict, list)):
        return json.dumps(value)
    return str(value)


def emit(args: argparse.Namespace, title: str, result: dict[str, Any], goals: dict[str, bool] | None = None) -> None:
    """Print ``result``: one JSON object (``--json``), else a two-column table."""
    result = {**result, **_CONTEXT}
    if getattr(args, "torch_threads", None) is not None:
        result["torch_threads"] = args.torch_threads
    if goals:
        result["goals"] = goals
    if args.json:
        print(json.dumps(result, default=_json_default), flush=True)
        return
    from rich.console import Console
    from rich.table import Table

    table = Table(title=title, show_header=True, header_style="bold")
    table.add_column("metric")
    table.add_column("value", justify="right")
    for key, value in result.items():
        if key == "goals":
            continue
        table.add_row(key, _fmt(value))
    for goal, ok in (goals or {}).items():
        table.add_row(f"goal: {goal}", "[green]met[/green]" if ok else "[red]missed[/red]")
    Console(file=sys.stdout, soft_wrap=True).print(table)


def _json_default(value: Any) -> Any:
    if hasattr(value, "item"):
        return value.item()
    return repr(value)


class Progress:
    """The bench's progress bar: ``with Progress(args, "pushing", total=n) as bar: bar.advance(k)``.

    Drawn on stderr only when it is a terminal and ``--json`` is not given. It is
    ``stream_reward.ops.logs.progress_bar``, so under ``stream-reward bench`` it nests
    as a line under the CLI's spinner instead of starting a second live display.
    """

    def __init__(self, args: argparse.Namespace, description: str, total: float | None) -> None:
        self._enabled = interactive(args)
        self._description = description
        self._total = int(total) if total is not None else None
        self._cm: Any = None
        self._handle: Any = None

    def __enter__(self) -> Progress:
        from stream_reward.ops.logs import progress_bar

        self._cm = progress_bar(self._description, total=self._total, enabled=self._enabled)
        self._handle = self._cm.__enter__()
        return self

    def advance(self, n: float = 1) -> None:
        if self._handle is not None:
            self._handle.advance(int(n))

    def update(self, completed: float, description: str | None = None) -> None:
        """Set the bar's position (``description`` names the phase; the bar keeps its first label)."""
        if self._handle is not None:
            self._handle.update(int(completed))

    def __exit__(self, *exc: object) -> None:
        if self._cm is not None:
            self._cm.__exit__(*exc)
            self._cm = self._handle = None


def plot_unavailable(args: argparse.Namespace) -> str | None:
    """Why ``--plot`` cannot work here (checked before a bench runs, not after), or None."""
    if not getattr(args, "plot", None):
        return None
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        return "--plot needs matplotlib (pip install matplotlib)"
    return None


def plot_figure(path: str) -> Any:
    """A fresh matplotlib figure on the Agg backend (no display needed)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def save_figure(fig: Any, path: str, dpi: int = 110) -> None:
    """Lay out ``fig``, write it to ``path`` and close it."""
    import matplotlib.pyplot as plt

    fig.tight_layout()
    fig.savefig(path, dpi=dpi)
    plt.close(fig)


def bench_main(
    name: str,
    argv: Sequence[str] | None,
    parse: Callable[[list[str]], argparse.Namespace],
    run: Callable[[argparse.Namespace], Any],
    plot: Callable[..., None],
    goals: Callable[[dict[str, Any]], dict[str, bool]],
    *,
    skip: Callable[[], str | None] | None = None,
    check_plot: bool = True,
) -> int:
    """A bench's ``main``: parse, refuse an unusable ``--plot`` up front (exit 2),
    report ``skip()``'s reason if it has one (exit 0), run ``run(args)``, plot, emit.

    ``run`` returns the result dict, or ``(result, *extra)``; the plot is then
    ``plot(path, result, *extra)``. ``goals(result)`` gives the goals emitted.
    """
    args = parse(list(argv or []))
    if check_plot:
        problem = plot_unavailable(args)
        if problem:
            print(f"bench {name}: {problem}", file=sys.stderr)
            return 2
    if skip is not None:
        reason = skip()
        if reason is not None:
            if args.json:
                print(json.dumps({"skipped": reason}))
            else:
                print(f"{name} skipped: {reason}")
            return 0
    out = asyncio.run(run(args))
    result, extra = (out[0], out[1:]) if isinstance(out, tuple) else (out, ())
    if args.plot:
        plot(args.plot, result, *extra)
    emit(args, f"stream-reward bench {name}", result, goals=goals(result))
    return 0


# ---------------------------------------------------------------------- stats
def percentile(values: Sequence[float], q: float) -> float:
    """The q-th percentile (0..100), linear interpolation; NaN for no values."""
    if not values:
        return math.nan
    data = sorted(values)
    pos = (len(data) - 1) * q / 100.0
    lo = math.floor(pos)
    hi = min(lo + 1, len(data) - 1)
    return data[lo] + (data[hi] - data[lo]) * (pos - lo)


def rss_bytes(pid: int) -> int:
    """Resident set size of a process, from /proc (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/status", encoding="ascii") as handle:
            for line in handle:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def cpu_seconds(pid: int) -> float:
    """User + system CPU time of a process so far, from /proc (0 if it is gone)."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii") as handle:
            fields = handle.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    except (OSError, IndexError, ValueError):
        return 0.0


class GcWatch:
    """Garbage-collector pauses of this process while active: a full collection of
    a heap holding torch takes ~0.1 s here, which shows up in latency tails."""

    def __init__(self) -> None:
        self.pauses: list[float] = []
        self._t0 = 0.0

    def _callback(self, phase: str, info: dict[str, Any]) -> None:
        if phase == "start":
            self._t0 = time.perf_counter()
        elif info.get("generation") == 2 or time.perf_counter() - self._t0 > 0.001:
            self.pauses.append(time.perf_counter() - self._t0)

    def __enter__(self) -> GcWatch:
        import gc

        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *exc: object) -> None:
        import gc

        gc.callbacks.remove(self._callback)

    def summary(self) -> dict[str, float]:
        return {
            "gc_pauses_over_1ms": len(self.pauses),
            "gc_max_pause_ms": round(max(self.pauses, default=0.0) * 1000, 1),
        }


# ---------------------------------------------------------------------- processes
# The folder holding the stream_reward package: children import the same code, installed or not.
REPO_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def child_env() -> dict[str, str]:
    """The environment for a bench's own child processes: the same ``stream_reward`` as this
    process, whatever the working directory."""
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(p for p in (REPO_ROOT, env.get("PYTHONPATH")) if p)
    return env


async def wait_for_workers(
    url: str, namespace: str, n: int, procs: Sequence[subprocess.Popen[bytes]], timeout_s: float = 60.0
) -> None:
    """Until ``n`` workers have heartbeated into the namespace (they have joined the group)."""
    from stream_reward.wire.connection import connect
    from stream_reward.wire.keys import Keys

    client = connect(url)
    try:
        loop = asyncio.get_running_loop()
        deadline = loop.time() + timeout_s
        while await client.hlen(Keys(namespace).workers()) < n:
            for proc in procs:
                if proc.poll() is not None:
                    raise RuntimeError(f"worker process {proc.pid} exited with code {proc.returncode} at start")
            if loop.time() > deadline:
                raise RuntimeError(f"workers did not join namespace {namespace!r} within {timeout_s}s")
            await asyncio.sleep(0.02)
    finally:
        await client.aclose()


def stop_procs(procs: Sequence[subprocess.Popen[Any]], timeout_s: float = 15.0) -> None:
    for proc in procs:
        if proc.poll() is None:
            with contextlib.suppress(ProcessLookupError):
                proc.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + timeout_s
    for proc in procs:
        try:
            proc.wait(timeout=max(0.1, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Workers:
    """``with Workers(url, ns, n, *worker_args) as w: await w.ready()``: project worker
    processes (``stream_reward.ops.pipeline.spawn_worker``), stopped on exit."""

    def __init__(self, url: str, namespace: str, n: int, *worker_args: str) -> None:
        from stream_reward.ops.pipeline import spawn_worker

        self.url, self.namespace, self.n = url, namespace, n
        self.procs = [spawn_worker(url, *worker_args, namespace=namespace) for _ in range(n)]

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.procs]

    async def ready(self, timeout_s: float = 60.0) -> None:
        await wait_for_workers(self.url, self.namespace, self.n, self.procs, timeout_s)

    def __enter__(self) -> Workers:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_procs(self.procs)


@contextlib.contextmanager
def quiet_server() -> Iterator[Any]:
    """A private embedded server (unix socket, no persistence), removed on exit."""
    from stream_reward.ops.embedded import EmbeddedServer

    with EmbeddedServer() as server:
        yield server


# ---------------------------------------------------------------------- data
_FILLER = (
    "Let me work through this carefully. First I restate the problem in my own words, then I set up the "
    "quantities, compute each intermediate value and check it against the constraints before moving on. "
)


def gsm8k_pool(rng: random.Random, size: int, target_bytes: int) -> list[dict[str, Any]]:
    """``size`` distinct GSM8K-style samples whose response is about ``target_bytes`` long,
    right about 70% of the time, with the ``#### answer`` at the end as verl expects.

    Benches cycle through a pool instead of building millions of distinct strings:
    what costs time in the pipeline is moving and scoring bytes, not their variety.
    """
    pool = []
    for _ in range(size):
        a, b, c = rng.randint(2, 99), rng.randint(2, 99), rng.randint(2, 9)
        answer = a + b * c
        roll = rng.random()
        if roll < 0.70:
            final = f"#### {answer}"
        elif roll < 0.90:
            final = f"#### {answer + rng.choice([-10, -1, 1, 7])}"
        else:
            final = f"So the answer is {answer}."
        core = f"First {b} * {c} = {b * c}. Then {a} + {b * c} = {answer}.\n{final}"
        pad = max(0, target_bytes - len(core))
        filler = (_FILLER * (pad // len(_FILLER) + 1))[:pad]
        response = filler + core
        pool.append(
            {
                "prompt": f"What is {a} + {b} * {c}?",
                "response": response,
                "ground_truth": str(answer),
                "valid_response_length": max(1, len(response) // 4),
            }
        )
    return pool


def payload_bytes(sample: dict[str, Any]) -> int:
    """Encoded size of one pool sample as a trajectory (what the stream carries)."""
    from stream_reward.wire.codec import encode_trajectory
    from stream_reward.wire.trajectory import Trajectory

    return len(
        encode_trajectory(
            Trajectory(
                batch_id="b0",
                index=0,
                data_source="openai/gsm8k",
                response=sample["response"],
                ground_truth=sample["ground_truth"],
                prompt=sample["prompt"],
                valid_response_length=sample["valid_response_length"],
                group="b0-0",
            )
        )
    )
