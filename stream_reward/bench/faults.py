"""`stream-reward bench faults`: a batch scored while worker processes are SIGKILLed.

N trajectories go through W worker processes; every ``--kill-every-s`` a random
worker is killed with SIGKILL and a replacement started, at least ``--kills``
times. Then every sample's result is checked: ``lost`` counts samples with no
result, ``duplicates`` counts extra results (ledger or done-stream entries beyond
one per uid, or aggregator rows beyond one per index). Both must be 0.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import signal
import sys
import time
from typing import Any

from stream_reward.config import ProducerConfig
from stream_reward.ops.embedded import EmbeddedServer
from stream_reward.ops.pipeline import spawn_worker
from stream_reward.trainer.aggregator import RewardAggregator
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.wire.connection import connect
from stream_reward.wire.keys import Keys
from stream_reward.wire.ledger import done_rows
from stream_reward.wire.trajectory import Trajectory

SCORER = "stream_reward.bench._fault_scorer:jittery"


async def run(n: int, workers: int, kills: int, kill_every_s: float, reclaim_idle_ms: int, seed: int) -> dict[str, Any]:
    rng = random.Random(seed)
    namespace = f"faults{int(time.time())}"
    batch = "faults"
    args = ("--scorer", SCORER, "--reclaim-idle-ms", str(reclaim_idle_ms), "--concurrency", "64")
    with EmbeddedServer() as server:
        url = server.url
        procs = [spawn_worker(url, *args, namespace=namespace) for _ in range(workers)]
        killed = 0
        pending_at_kills: list[int] = []
        started = time.perf_counter()
        try:
            async with (
                RolloutProducer(url, ProducerConfig(namespace=namespace)) as producer,
                RewardAggregator(url, namespace=namespace) as agg,
            ):
                await producer.open_batch(batch, n, 64)
                trajs = [
                    Trajectory(
                        batch,
                        i,
                        "bench",
                        response=str(i),
                        ground_truth=str(i if i % 3 else -1),
                        valid_response_length=1 + i % 64,
                    )
                    for i in range(n)
                ]
                collect = asyncio.create_task(agg.collect(batch, timeout_s=600))

                async def push() -> None:
                    for pos in range(0, n, 200):
                        await producer.push_many(trajs[pos : pos + 200])
                        await asyncio.sleep(0.01)

                pusher = asyncio.create_task(push())
                while not collect.done() and (killed < kills or not pusher.done()):
                    await asyncio.sleep(kill_every_s)
                    if collect.done() or killed >= kills:
                        continue
                    # A random worker among those holding unacked entries: a kill should cost something.
                    stream = Keys(namespace).stream()
                    pending = [await _pending_of(producer.client, stream, p.pid) for p in procs]
                    busy = [i for i, count in enumerate(pending) if count] or list(range(len(procs)))
                    victim = rng.choice(busy)
                    pending_at_kills.append(pending[victim])
                    procs[victim].send_signal(signal.SIGKILL)
                    procs[victim].wait()
                    procs[victim] = spawn_worker(url, *args, namespace=namespace)
                    killed += 1
                await pusher
                rewards = await collect
            elapsed = time.perf_counter() - started
            keys = Keys(namespace)
            client = connect(url)
            try:
                ledger = await client.hlen(keys.results(batch))
                done = sum(len(done_rows(fields)[0]) for _, fields in await client.xrange(keys.done(batch)))
                dead = await client.xlen(keys.dead_letters())
            finally:
                await client.aclose()
        finally:
            for proc in procs:
                proc.terminate()
            for proc in procs:
                proc.wait()
    expected = [1.0 if i % 3 else 0.0 for i in range(n)]
    ok = [r for r in rewards.results if r is not None and r.status == "ok"]
    wrong = sum(1 for i, s in enumerate(rewards.scores) if rewards.status[i] == "ok" and s != expected[i])
    return {
        "n": n,
        "scored": len(ok),
        "failed": rewards.status.count("failed"),
        "lost": n - len({r.index for r in rewards.results if r is not None and r.uid}),
        "duplicates": (ledger - n) + (done - n) + (len(rewards.indices) - len(set(rewards.indices))),
        "wrong_scores": wrong,
        "dead_letters": dead,
        "kills": killed,
        "in_flight_at_kills": pending_at_kills,  # the victim's unacked entries when it died
        "workers": workers,
        "elapsed_s": round(elapsed, 2),
    }


async def _pending_of(client: Any, stream: str, pid: int) -> int:
    summary = await client.xpending(stream, "scorers")
    for consumer in summary.get("consumers") or []:
        if consumer["name"].decode().endswith(f"-{pid}"):
            return int(consumer["pending"])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="stream-reward bench faults", description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=10_000)
    parser.add_argument("--workers", type=int, default=3)
    parser.add_argument("--kills", type=int, default=5)
    parser.add_argument("--kill-every-s", type=float, default=0.3)
    parser.add_argument("--reclaim-idle-ms", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", action="store_true")
    args = parser.parse_args(argv)
    report = asyncio.run(run(args.n, args.workers, args.kills, args.kill_every_s, args.reclaim_idle_ms, args.seed))
    if args.json:
        print(json.dumps(report))
    else:
        for key, value in report.items():
            print(f"{key:>14}: {value}")
    ok = report["lost"] == 0 and report["duplicates"] == 0 and report["wrong_scores"] == 0
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
