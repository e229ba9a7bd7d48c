"""The ``stream-reward`` command. Thin: each subcommand parses, then calls the library."""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from .errors import StreamRewardError
from .keys import DEFAULT_NAMESPACE

__all__ = ["main"]

log = logging.getLogger("stream_reward")


def _add_common(parser: argparse.ArgumentParser, *, redis_required: bool = False) -> None:
    parser.add_argument("--redis", required=redis_required, default=None, help="Redis URL; none: a private embedded server")
    parser.add_argument("--namespace", default=DEFAULT_NAMESPACE)


# ---------------------------------------------------------------------- commands
def cmd_server(args: argparse.Namespace) -> int:
    from .embedded import EmbeddedServer

    with EmbeddedServer(appendonly=args.appendonly) as server:
        print(server.url, flush=True)
        stop = {"flag": False}

        def on_signal(signum: int, frame: Any) -> None:
            stop["flag"] = True

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        while not stop["flag"]:
            time.sleep(0.2)
    return 0


def cmd_worker(args: argparse.Namespace) -> int:
    from workers.main import run_from_args

    return run_from_args(args)


def cmd_produce(args: argparse.Namespace) -> int:
    from .config import ProducerConfig
    from .jsonl import produce_rollouts, read_rollouts

    rollouts = read_rollouts(args.file, args.batch)
    for error in rollouts.bad_lines.values():
        print(f"{args.file}: {error}", file=sys.stderr)
    asyncio.run(produce_rollouts(args.redis, rollouts, args.response_len, ProducerConfig(namespace=args.namespace)))
    print(json.dumps({"batch": args.batch, "pushed": len(rollouts.trajectories), "bad_lines": len(rollouts.bad_lines)}))
    return 0


def cmd_collect(args: argparse.Namespace) -> int:
    from .aggregator import RewardAggregator

    async def run() -> Any:
        async with RewardAggregator(args.redis, namespace=args.namespace) as agg:
            return await agg.collect(args.batch, timeout_s=args.timeout)

    rewards = asyncio.run(run())
    if args.out:
        import torch

        torch.save({"rm_scores": rewards.rm_scores, "valid": rewards.valid, "scores": rewards.scores,
                    "status": rewards.status, "indices": rewards.indices,
                    "reward_extra_info": rewards.reward_extra_info}, args.out)
    summary = {
        "batch": args.batch, "n": rewards.n, "scores": rewards.scores, "status": rewards.status,
        "rm_scores_shape": list(rewards.rm_scores.shape), "reward_extra_info": rewards.reward_extra_info,
        "indices": rewards.indices, "errors": rewards.errors,
    }
    if args.json:
        print(json.dumps(summary, default=repr))
    else:
        counts = rewards.status_counts()
        print(f"batch {args.batch}: n={rewards.n} status={counts} rm_scores={tuple(rewards.rm_scores.shape)}")
        for index, score, status in zip(rewards.indices, rewards.scores, rewards.status):
            print(f"  {index:>6}  {status:<6}  {score:.4f}")
    return 0


def cmd_score(args: argparse.Namespace) -> int:
    from .aggregator import RewardAggregator
    from .jsonl import produce_rollouts, read_rollouts, result_rows
    from .local import LocalPipeline

    batch_id = f"score-{int(time.time() * 1000)}"
    rollouts = read_rollouts(args.file, batch_id)
    for error in rollouts.bad_lines.values():
        print(f"{args.file}: {error}", file=sys.stderr)
    worker_args = ["--scorer", args.scorer, "--manager", args.manager]
    with LocalPipeline(args.redis, processes=args.processes, namespace=args.namespace, worker_args=worker_args) as pipeline:
        async def run() -> Any:
            await produce_rollouts(pipeline.url, rollouts, args.response_len)
            async with RewardAggregator(pipeline.url, namespace=args.namespace) as agg:
                return await agg.collect(batch_id, timeout_s=args.timeout)

        rewards = asyncio.run(run())
    rows = result_rows(rewards)
    out = open(args.out, "w", encoding="utf-8") if args.out else sys.stdout
    try:
        for row in rows:
            out.write(json.dumps(row, default=repr) + "\n")
    finally:
        if args.out:
            out.close()
    if args.out:
        print(f"scored {len(rows)} samples: {rewards.status_counts()} -> {args.out}", file=sys.stderr)
    return 0


def cmd_demo(args: argparse.Namespace) -> int:
    from .demo import run_demo
    from .local import LocalPipeline

    with LocalPipeline(args.redis, processes=args.processes, namespace=args.namespace) as pipeline:
        report = asyncio.run(run_demo(pipeline.url, args.n, namespace=args.namespace, generation_s=args.generation_s))
    if args.json:
        print(json.dumps(report.as_dict()))
    else:
        print(f"stream-reward demo: {report.n} trajectories, {args.processes} worker processes")
        print(f"  status:      {report.status}")
        print(f"  accuracy:    {report.accuracy:.3f}")
        print(f"  throughput:  {report.throughput_traj_per_s:,.0f} trajectories/s (over the whole step)")
        print(f"  generation:  {report.generation_s:.2f} s (last push)")
        print(f"  reward tail: {report.reward_tail_s * 1000:.1f} ms (last push -> rm_scores ready)")
        print(f"  rm_scores:   {report.rm_scores_shape} float32")
    return 0


BENCHES = ("throughput", "overlap", "latency", "memory", "vs_verl", "quota", "sandbox", "faults", "scale")


def cmd_bench(args: argparse.Namespace) -> int:
    """Each bench is ``benchmarks/NAME.py`` with ``main(argv) -> int``."""
    import importlib

    module = importlib.import_module(f"benchmarks.{args.name}")
    return int(module.main(args.rest) or 0)


# ---------------------------------------------------------------------- parser
def build_parser() -> argparse.ArgumentParser:
    from workers.main import add_worker_arguments

    parser = argparse.ArgumentParser(prog="stream-reward", description="Async streaming reward pipeline for LLM RL.")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("demo", help="simulated rollout step scored as it streams (embedded server if no --redis)")
    _add_common(p)
    p.add_argument("--n", type=int, default=2000)
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--generation-s", type=float, default=3.0, help="simulated generation time of the step")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_demo)

    p = sub.add_parser("server", help="run an embedded server in the foreground; prints its URL first")
    p.add_argument("--appendonly", action="store_true", help="persist with AOF in the server's temp dir")
    p.set_defaults(func=cmd_server)

    p = sub.add_parser("worker", help="run a pool of worker processes")
    add_worker_arguments(p)
    p.set_defaults(func=cmd_worker)

    p = sub.add_parser("produce", help="push a JSONL dump of rollouts as one batch")
    _add_common(p, redis_required=True)
    p.add_argument("--batch", required=True)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("file")
    p.set_defaults(func=cmd_produce)

    p = sub.add_parser("collect", help="wait for a batch and print / save its rewards")
    _add_common(p, redis_required=True)
    p.add_argument("--batch", required=True)
    p.add_argument("--timeout", type=float, default=None, help="seconds")
    p.add_argument("--out", help="save tensors to FILE.pt")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=cmd_collect)

    p = sub.add_parser("score", help="score a JSONL dump of rollouts end to end; one JSON line per input line")
    _add_common(p)
    p.add_argument("file")
    p.add_argument("--out")
    p.add_argument("--scorer", default="rules")
    p.add_argument("--manager", default="naive")
    p.add_argument("--processes", type=int, default=2)
    p.add_argument("--response-len", type=int, default=1024)
    p.add_argument("--timeout", type=float, default=600.0)
    p.set_defaults(func=cmd_score)

    p = sub.add_parser("bench", help="run a benchmark: " + ", ".join(BENCHES))
    p.add_argument("name", choices=BENCHES)
    p.add_argument("rest", nargs=argparse.REMAINDER, help="the bench's own flags (--json, --plot FILE.png, ...)")
    p.set_defaults(func=cmd_bench)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command != "worker":
        logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    func: Callable[[argparse.Namespace], int] = args.func
    try:
        return func(args)
    except StreamRewardError as exc:
        print(f"stream-reward {args.command}: {exc}", file=sys.stderr)
        return 2
    except FileNotFoundError as exc:
        print(f"stream-reward {args.command}: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
