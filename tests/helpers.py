"""Helpers the test files share: polling for a condition, scoring one batch end to end, and
listing what is queued."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import gc
import random
import selectors
import subprocess
import time
import warnings
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

from stream_reward import (
    BatchPolicy,
    BatchRewards,
    ProducerConfig,
    RewardAggregator,
    RolloutProducer,
    ScoreResult,
    Trajectory,
)
from stream_reward.config import ConsumerConfig
from stream_reward.errors import BackpressureError
from stream_reward.scoring.scorer import Scored
from stream_reward.wire.codec import decode_trajectory
from stream_reward.wire.connection import connect
from stream_reward.wire.deadletter import encode_dead_letter
from stream_reward.wire.entries import FIELD_HANDED_BACK, FIELD_PAYLOAD, read_members
from stream_reward.wire.keys import Keys
from stream_reward.wire.lane import Lane
from stream_reward.wire.packed import pack_command
from stream_reward.worker.consumer import Worker


@contextlib.asynccontextmanager
async def producer_and_aggregator(url: str, namespace: str) -> AsyncIterator[tuple[RolloutProducer, RewardAggregator]]:
    """A trainer's two ends on ``namespace``, closed on exit."""
    async with (
        RolloutProducer(url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(url, namespace=namespace) as agg,
    ):
        yield producer, agg


async def wait_until(
    predicate: Callable[[], Awaitable[object]], timeout_s: float = 30.0, every_s: float = 0.05
) -> None:
    """Poll ``predicate`` until it is true; fail the test if it is not within ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if await predicate():
            return
        await asyncio.sleep(every_s)
    raise AssertionError("condition not reached in time")


async def score_batch(
    redis_url: str,
    namespace: str,
    trajs: list[Trajectory],
    *,
    width: int = 8,
    policy: BatchPolicy | None = None,
    timeout_s: float = 30,
) -> BatchRewards:
    """Open the trajectories' batch, push them all, collect: what a trainer does with running workers."""
    batch_id = trajs[0].batch_id
    async with (
        RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as producer,
        RewardAggregator(redis_url, namespace=namespace) as agg,
    ):
        await producer.open_batch(batch_id, len(trajs), width, policy=policy)
        await producer.push_many(trajs)
        return await agg.collect(batch_id, timeout_s=timeout_s)


async def done_results(client, done_key: str) -> list:
    """Every result record in a done stream, in order, as ScoreResults (a done-stream
    entry holds one worker flush's records back to back, see wire/ledger.py)."""
    from stream_reward.wire.codec import result_from_row
    from stream_reward.wire.ledger import done_rows

    out = []
    for _, fields in await client.xrange(done_key):
        rows, broken = done_rows(fields)
        assert broken is None, broken
        out += [result_from_row(row) for row in rows]
    return out


def samples_of(fields: dict) -> list[Trajectory]:
    """The trajectories one stream entry holds (one or more: see wire/entries.py)."""
    members = read_members(fields)
    assert members is not None, f"an entry with unreadable headers: {fields!r}"
    out, at = [], 0
    for batch, index, uid, size in members:
        t = decode_trajectory(fields[FIELD_PAYLOAD][at : at + size])
        assert (t.batch_id, t.index, t.uid) == (batch, index, uid), "a header names another sample"
        out.append(t)
        at += size
    return out


async def queued(redis_url: str, keys: Keys) -> list[tuple[str, str, int]]:
    """(batch, uid, index) of every sample producers queued in every stream of ``keys``, stream
    by stream (not the copies a worker handed back: see Worker._spill)."""
    client = connect(redis_url)
    try:
        out = []
        for stream in keys.streams():
            for _, fields in await client.xrange(stream):
                if FIELD_HANDED_BACK not in fields:
                    out += [(t.batch_id, t.uid, t.index) for t in samples_of(fields)]
        return out
    finally:
        await client.aclose()


async def pending_samples(redis_url: str, namespace: str, partitions: int = 1, group: str = "scorers") -> int:
    """Samples delivered to the group's consumers and not yet acked (XPENDING counts entries)."""
    client = connect(redis_url)
    try:
        total = 0
        for stream in Keys(namespace, partitions).streams():
            for row in await client.xpending_range(stream, group, min="-", max="+", count=100_000):
                for _, fields in await client.xrange(stream, min=row["message_id"], max=row["message_id"]):
                    total += len(samples_of(fields))
        return total
    finally:
        await client.aclose()


# The tests of entries of several samples (tests/worker/, tests/wire/test_entries.py) share these.


def exact_traj(batch: str, i: int, uid: str | None = None) -> Trajectory:
    """A sample for the test/exact data source; ``Timed`` scores it by its identity."""
    kw = {"uid": uid} if uid else {}
    return Trajectory(batch, i, "test/exact", response=f"r{i}", ground_truth="1", **kw)


def identity_score(t: Trajectory) -> float:
    """index + len(response)/1000: a sample scored with another's score shows."""
    return t.index + len(t.response) / 1000


class Timed:
    """Scores a sample by its identity after ``delays[index]`` (default ``delay``, plus up
    to ``jitter``); records the uids it was asked for in ``seen``."""

    inline = False

    def __init__(self, delay: float = 0.0, jitter: float = 0.0, delays: dict[int, float] | None = None) -> None:
        self.delay, self.jitter, self.delays = delay, jitter, delays or {}
        self.seen: list[str] = []

    async def score(self, t: Trajectory) -> Scored:
        self.seen.append(t.uid)
        d = self.delays.get(t.index, self.delay) + random.random() * self.jitter
        if d:
            await asyncio.sleep(d)
        return Scored(identity_score(t))


async def undelivered_samples(client, keys: Keys, group: str = "scorers") -> int:
    """Samples in entries the group has not been delivered yet (the truth max_backlog bounds)."""
    total = 0
    for stream in keys.streams():
        (info,) = [g for g in await client.xinfo_groups(stream) if g["name"] in (group, group.encode())]
        last = info["last-delivered-id"]
        last = last.decode() if isinstance(last, bytes) else last
        for _, fields in await client.xrange(stream, min=f"({last}" if last != "0-0" else "-"):
            total += len(samples_of(fields))
    return total


@contextlib.asynccontextmanager
async def started(worker) -> AsyncIterator:
    """``worker`` running in this loop until the block ends (then stopped, drained, closed)."""
    stop = asyncio.Event()
    task = asyncio.ensure_future(worker.run(stop))
    try:
        yield worker
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await worker.aclose()


@contextlib.asynccontextmanager
async def running_worker(url: str, ns: str, scorer, client=None, **cfg) -> AsyncIterator:
    """A worker running in this loop until the block ends (then stopped and drained)."""
    from stream_reward.worker.consumer import Worker

    config = ConsumerConfig(namespace=ns, **{"block_ms": 20, "drain_timeout_s": 0.3, **cfg})
    async with started(Worker(url, scorer, config, client=client)) as w:
        yield w


class Counting:
    """Scores by identity; the first attempt of each sample takes ``first`` seconds (a stop
    cancels it), later ones ``later``. ``calls`` counts attempts per uid; ``started`` is set
    at the first call; ``cancelled`` lists the uids whose attempt was cancelled;
    ``on_first`` runs at each sample's first attempt."""

    inline = False

    def __init__(self, first: float = 5.0, later: float = 0.0, on_first: Callable[[], object] | None = None) -> None:
        self.first, self.later, self.on_first = first, later, on_first
        self.calls: dict[str, int] = {}
        self.cancelled: list[str] = []
        self.started = asyncio.Event()

    async def score(self, t: Trajectory) -> Scored:
        self.calls[t.uid] = self.calls.get(t.uid, 0) + 1
        self.started.set()
        if self.on_first is not None and self.calls[t.uid] == 1:
            self.on_first()
        try:
            await asyncio.sleep(self.first if self.calls[t.uid] == 1 else self.later)
        except asyncio.CancelledError:
            self.cancelled.append(t.uid)
            raise
        return Scored(identity_score(t))


def stop_config(namespace: str, consumer: str, **kw) -> ConsumerConfig:
    """A worker's config for the stop tests: short reads, a 0.3 s drain, concurrency 4."""
    return ConsumerConfig(
        namespace=namespace, consumer=consumer, **{"block_ms": 20, "drain_timeout_s": 0.3, "concurrency": 4, **kw}
    )


async def push_exact(redis_url: str, namespace: str, batch: str, n: int, k: int = 1) -> None:
    """Open ``batch`` and push ``n`` exact_traj samples, ``k`` to a stream entry."""
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace, samples_per_entry=k)) as p:
        await p.open_batch(batch, n, 8)
        await p.push_many([exact_traj(batch, i) for i in range(n)])


async def assert_each_once(url: str, ns: str, batch: str, rewards: Any, n: int, partitions: int = 1) -> None:
    """Every exact_traj sample of ``batch`` ok with its own score, one result record each in
    the done streams, no entry left pending."""
    assert [(r.index, r.status, r.score) for r in rewards.results] == [
        (i, "ok", identity_score(exact_traj(batch, i))) for i in range(n)
    ]
    keys = Keys(ns, partitions)
    admin = connect(url)
    try:
        records = []
        for p in range(partitions):
            records += await done_results(admin, keys.done(batch, p))
        assert sorted(r.index for r in records) == list(range(n)), "a result counted twice or lost"
        for stream in keys.streams():
            assert (await admin.xpending(stream, "scorers"))["pending"] == 0, f"{stream}: entries left unacked"
    finally:
        await admin.aclose()


def unsettled(rewards: BatchRewards) -> list:
    """(index, status, reason) of the samples that did not end ``ok``."""
    return [(r.index, r.status, r.reason) for r in rewards.results if r.status != "ok"]


def no_waiters(p: RolloutProducer) -> None:
    """Nothing left in the producer's result listener: no timeout due, no waiter."""
    listener = p._listener
    if listener is None:
        return
    assert sum(len(d) for d in listener._due.values()) == 0, listener._due
    left = {u: f for r in listener._readers.values() for s in r.streams.values() for u, f in s.waiters.items()}
    assert not left, left


def lane_of(client: object) -> Lane:
    """The lane a plain single-node client gets (the test fails if it gets none)."""
    lane = Lane.for_client(client)
    assert lane is not None
    return lane


def start_in_own_group(argv: list[str], **kwargs: Any) -> subprocess.Popen[bytes]:
    """A CLI process in a session of its own, run from the repository, stderr piped: a
    ``killpg`` reaches it and its children, as a terminal's Ctrl-C does."""
    return subprocess.Popen(
        argv,
        cwd=Path(__file__).resolve().parent.parent,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        **kwargs,
    )


class CutProxy:
    """TCP in front of the unix-socket server. ``arm(marker)``: the next request holding
    ``marker`` is passed on (so the server runs it), and the server's next bytes on that
    connection (its reply) are swallowed and both sides closed: a reply lost after the
    command ran, the worst moment for a retry. ``black = True``: every byte either way
    is swallowed and connections stay open, as through a path that drops packets."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.marker = b""
        self.arms = 0
        self.cuts = 0
        self.black = False
        self.tasks: set[asyncio.Task] = set()

    async def __aenter__(self) -> CutProxy:
        self.server = await asyncio.start_server(self._handle, "127.0.0.1", 0)
        self.url = f"redis://127.0.0.1:{self.server.sockets[0].getsockname()[1]}"
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.server.close()
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)
        await self.server.wait_closed()

    def arm(self, marker: bytes, times: int = 1) -> None:
        self.marker, self.arms = marker, times

    async def _handle(self, cr: asyncio.StreamReader, cw: asyncio.StreamWriter) -> None:
        task = asyncio.current_task()
        assert task is not None
        self.tasks.add(task)
        sw = None
        cut = False
        try:
            sr, sw = await asyncio.open_unix_connection(self.path)

            async def up() -> None:
                nonlocal cut
                while data := await cr.read(65536):
                    if self.black:
                        continue
                    if self.arms and self.marker in data:
                        self.arms -= 1
                        cut = True
                    sw.write(data)
                    await sw.drain()

            async def down() -> None:
                while data := await sr.read(65536):
                    if self.black:
                        continue
                    if cut:
                        self.cuts += 1
                        return
                    cw.write(data)
                    await cw.drain()

            pumps = [asyncio.ensure_future(up()), asyncio.ensure_future(down())]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for p in pumps:
                    p.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        except (OSError, asyncio.CancelledError):
            pass
        finally:
            cw.close()
            if sw is not None:
                sw.close()
            self.tasks.discard(task)


class FailoverProxy(CutProxy):
    """TCP in front of a unix-socket server that can fail over, as a cluster's address does
    after a promotion: ``fail_over(path)`` cuts every open connection, and new ones go to
    the server at ``path``."""

    async def fail_over(self, path: str) -> None:
        self.path = path
        for task in list(self.tasks):
            task.cancel()
        await asyncio.gather(*self.tasks, return_exceptions=True)


def free_tcp_port() -> int:
    """A TCP port on 127.0.0.1 nobody listens on now (for a replica to reach its primary)."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def backlog_traj(batch: str, i: int) -> Trajectory:
    # A GRPO group each: with several partitions the samples spread over them.
    return Trajectory(batch, i, "test/exact", response=str(i), ground_truth=str(i), group=f"{batch}-{i}")


async def refusals_of_pushes_that_fit(url: str, namespace: str, partitions: int, rounds: int = 15) -> list[str]:
    """No worker runs, so the backlog is exactly what was pushed. Each round: let the
    estimate go stale, push one sample (it starts a reading in the background and lands
    while the reading is on its way), let the reading end, then push up to the limit
    exactly. A push counted twice makes the last one raise."""
    limit = 20
    config = ProducerConfig(
        namespace=namespace, partitions=partitions, max_backlog=limit, on_backlog="raise", backlog_poll_s=0.02
    )
    refused = []
    async with RolloutProducer(url, config) as producer:
        for r in range(rounds):
            batch = f"r{r}"
            await producer.open_batch(batch, limit, 4)
            await producer.push_many(backlog_traj(batch, i) for i in range(limit - 10))
            await asyncio.sleep(0.03)  # the estimate is stale: the next push starts a reading
            await producer.push(backlog_traj(batch, limit - 10))
            reading = producer._backlog_reading
            assert reading is not None
            await reading
            try:
                # limit - 9 queued in this batch; 9 more fill it exactly
                await producer.push_many(backlog_traj(batch, i) for i in range(limit - 9, limit))
            except BackpressureError as exc:
                refused.append(str(exc))
            else:
                assert await producer.backlog() == limit  # the test's own premise: nothing else queued
            # the group takes everything (no worker scores it): an empty backlog for the next round
            for p in range(partitions):
                await producer.client.xreadgroup(config.group, "drain", {producer.keys.stream(p): ">"}, count=10_000)
            await asyncio.sleep(0.03)
    return refused


async def backlog_truth(url: str, namespace: str, partitions: int = 1) -> int:
    """The backlog as another producer reads it."""
    async with RolloutProducer(url, ProducerConfig(namespace=namespace, partitions=partitions)) as other:
        return await other.backlog()


class ReadHold:
    """The producer's next readings stop before their round trips (``before``) and/or
    after them (``after``): ``read`` is set once the server answered (the HMGET ran)."""

    def __init__(self, producer: RolloutProducer, *, before: bool = False, after: bool = False, fail: bool = False):
        self.producer = producer
        self.name = "_read_counts"  # the reading's round trips
        self.orig = getattr(producer, self.name)
        self.go_read = asyncio.Event()
        self.go_return = asyncio.Event()
        self.read = asyncio.Event()
        if not before:
            self.go_read.set()
        if not after:
            self.go_return.set()
        self.fail = fail

        async def held() -> Any:
            await self.go_read.wait()
            result = await self.orig()
            self.read.set()
            await self.go_return.wait()
            if self.fail:
                raise ConnectionError("reading failed (simulated connection loss after the server answered)")
            return result

        setattr(producer, self.name, held)

    def restore(self) -> None:
        setattr(self.producer, self.name, self.orig)


class SendHold:
    """The producer's next ``calls`` push sends are held before reaching Redis until
    ``go_send``, and their replies are held back until ``go_reply``."""

    def __init__(self, producer: RolloutProducer, *, calls: int = 1, before: bool = False, reply: bool = False):
        self.producer = producer
        self.orig = producer._send_packed
        self.go_send = asyncio.Event()
        self.go_reply = asyncio.Event()
        self.landed = asyncio.Event()
        self.entered = asyncio.Event()
        if not before:
            self.go_send.set()
        if not reply:
            self.go_reply.set()
        self.left = calls

        async def held(packed: list[bytes]) -> list[Any]:
            if self.left <= 0:
                return await self.orig(packed)
            self.left -= 1
            self.entered.set()
            await self.go_send.wait()
            replies = await self.orig(packed)
            self.landed.set()
            await self.go_reply.wait()
            return replies

        producer._send_packed = held  # type: ignore[method-assign]

    def restore(self) -> None:
        self.producer._send_packed = self.orig  # type: ignore[method-assign]


async def backlog_ready(producer: RolloutProducer, batch: str, size: int = 100) -> None:
    """Open the batch, push sample 0 (groups and script ready), let the first reading end."""
    await producer.open_batch(batch, size, 4)
    await producer.push(backlog_traj(batch, 0))
    if producer._backlog_reading is not None:
        await producer._backlog_reading


# ---------------------------------------------------------------------- programs under test (ops)
def worker_program_argv(url: str, namespace: str, *args: str) -> list[str]:
    """``python -m workers`` (the worker program, or a pool with ``--processes``) on ``url``."""
    import sys

    return [sys.executable, "-m", "workers", "--redis", url, "--namespace", namespace, "--log-level", "WARNING", *args]


def sleepy_batch(batch_id: str, n: int, sleep_s: float) -> list[Trajectory]:
    """Samples that ``tests/data/failwell_scorers.py:slow`` scores after ``sleep_s`` each."""
    return [
        Trajectory(batch_id, i, "test", response="ok", valid_response_length=1, extra_info={"sleep_s": sleep_s})
        for i in range(n)
    ]


def timed_wait(proc: subprocess.Popen[bytes], limit_s: float) -> tuple[int | None, float]:
    """(exit code or None if still running after limit_s, seconds waited); kills a survivor."""
    started = time.monotonic()
    try:
        code = proc.wait(timeout=limit_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()
        return None, time.monotonic() - started
    return code, time.monotonic() - started


def read_err(proc: subprocess.Popen[bytes]) -> str:
    """What a process with a piped stderr wrote there (it has exited)."""
    assert proc.stderr is not None
    with proc.stderr:
        return proc.stderr.read().decode()


def session_processes(sid: int) -> list[tuple[int, str]]:
    """The live processes of session ``sid``: (pid, command line)."""
    out = []
    for p in Path("/proc").iterdir():
        if not p.name.isdigit():
            continue
        try:
            stat = (p / "stat").read_text()
            rest = stat[stat.rindex(")") + 2 :].split()
            if int(rest[3]) == sid and rest[0] != "Z":
                cmd = (p / "cmdline").read_bytes().replace(b"\0", b" ").decode()[:200]
                out.append((int(p.name), cmd))
        except (OSError, ValueError, IndexError):
            pass
    return out


def _default_sigint() -> None:
    import signal

    signal.signal(signal.SIGINT, signal.SIG_DFL)


def run_in_own_session(code: str, args: list[str], limit_s: float, env: dict | None = None) -> tuple:
    """``python -c code *args`` in a session of its own: (exit code or None on a hang,
    seconds, stderr, processes of its session left behind); the session is killed after."""
    import os
    import signal
    import sys

    proc = subprocess.Popen(
        [sys.executable, "-c", code, *args],
        cwd=Path(__file__).resolve().parent.parent,
        start_new_session=True,
        stdin=subprocess.DEVNULL,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env={**os.environ, **(env or {})},
        # As from a terminal: a SIGINT ignored by whoever runs the tests (a background job
        # of a non-interactive shell) would be inherited, and Python keeps it ignored.
        preexec_fn=_default_sigint,
    )
    started = time.monotonic()
    try:
        try:
            _, err = proc.communicate(timeout=limit_s)
            rc: int | None = proc.returncode
        except subprocess.TimeoutExpired:
            rc = None
        took = time.monotonic() - started
        time.sleep(0.5)
        left = session_processes(proc.pid)
    finally:
        for pid, _ in session_processes(proc.pid):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(os.getpgid(pid), signal.SIGKILL)
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGKILL)
        if proc.returncode is None:
            _, err = proc.communicate()
    return rc, round(took, 1), err.decode(errors="replace"), left


def run_to_end(proc: subprocess.Popen[bytes], timeout: float = 40) -> tuple[int | None, str]:
    """Its exit status and stderr; status None for a program still running at ``timeout``
    (the signal was lost), which is then killed."""
    try:
        _, err = proc.communicate(timeout=timeout)
        code: int | None = proc.returncode
    except subprocess.TimeoutExpired:
        code = None
        proc.kill()
        _, err = proc.communicate()
    return code, err.decode(errors="replace")


def said(stderr: str) -> list[str]:
    """The lines a program said on stderr, blank ones left out."""
    return [line for line in stderr.splitlines() if line.strip()]


def stream_reward_cli(
    *args: str, timeout_s: float = 60, **kwargs: Any
) -> tuple[subprocess.CompletedProcess[str], float]:
    """``python -m stream_reward.cli *args`` run to its end from the repository: (the run, seconds)."""
    import sys

    started = time.monotonic()
    done = subprocess.run(
        [sys.executable, "-m", "stream_reward.cli", *args],
        capture_output=True,
        text=True,
        timeout=timeout_s,
        cwd=Path(__file__).resolve().parent.parent,
        stdin=subprocess.DEVNULL,
        **kwargs,
    )
    return done, time.monotonic() - started


def one_line(stderr: str) -> str:
    """The single line a program said on stderr (no traceback, nothing else)."""
    lines = said(stderr)
    assert "Traceback" not in stderr, stderr
    assert len(lines) == 1, stderr
    return lines[0]


def worker_heartbeat(name: str, seen: float, **fields: Any) -> bytes:
    """A worker's heartbeat as it writes it into ``Keys.workers()``, last ``seen`` then."""
    import msgpack

    beat = {
        "host": "h1",
        "pid": 4242,
        "started": seen - 100,
        "seen": seen,
        "group": "scorers",
        "scorer": "RuleScorer",
        "scored": 0,
        "failed": 0,
        "duplicates": 0,
        "dead_letters": 0,
        "reclaimed": 0,
        "in_flight": 0,
        **fields,
    }
    return bytes(msgpack.packb(beat))


def metric_samples(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    """Prometheus text exposition -> {(sample name, sorted labels): value}."""
    from prometheus_client.parser import text_string_to_metric_families

    out = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            out[(sample.name, tuple(sorted(sample.labels.items())))] = sample.value
    return out


def metric_value(samples: dict, name: str, **labels: str) -> float | None:
    return samples.get((name, tuple(sorted(labels.items()))))


class _FastForwardSelector(selectors.DefaultSelector):
    """A selector that, when nothing is ready and the loop would sleep until its next timer,
    moves the loop's virtual clock to that timer instead of sleeping."""

    def __init__(self, loop: VirtualClockLoop) -> None:
        super().__init__()
        self._loop = loop

    def select(self, timeout: float | None = None) -> list[Any]:
        ready = super().select(0)
        if ready or timeout == 0:
            return ready
        if timeout is None:  # no timer at all: only I/O (a thread's wakeup) can go on
            return super().select(None)
        self._loop.virtual_now += timeout
        return []


class VirtualClockLoop(asyncio.SelectorEventLoop):
    """An event loop on a virtual clock (the aiolimiter way: time the test controls). Time
    stands still while callbacks run and jumps to the next timer when the loop is idle: a
    ``sleep(0.4)`` takes no real time, and a loaded machine cannot stretch a gap between
    two awaits. For tests whose code waits only on timers and on itself, not on sockets or
    processes (those would fall behind the clock)."""

    def __init__(self) -> None:
        self.virtual_now = 1000.0
        super().__init__(_FastForwardSelector(self))

    def time(self) -> float:
        return self.virtual_now


class LoopLag:
    """How late this event loop ran, at worst, while the block ran: a probe asks to wake
    every ``every_s`` and records how much later it woke. A deadline a test checks in real
    time can be late by this much without the code under test being late: the loop (or the
    whole process, beside a CPU hog) was not running."""

    def __init__(self, every_s: float = 0.01) -> None:
        self.every_s = every_s
        self.worst_s = 0.0
        self._task: asyncio.Task[None] | None = None

    async def _probe(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            asked = loop.time() + self.every_s
            await asyncio.sleep(self.every_s)
            self.worst_s = max(self.worst_s, loop.time() - asked)

    async def __aenter__(self) -> LoopLag:
        self._task = asyncio.ensure_future(self._probe())
        return self

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None
        self._task.cancel()
        await asyncio.gather(self._task, return_exceptions=True)


async def wait_for_workers(redis_url: str, namespace: str, n: int, timeout_s: float = 30) -> None:
    """Until ``n`` worker processes have joined (heartbeated): a test about how work
    spreads over processes, or one that times its scoring, must not start while one of them
    is still importing."""
    client = connect(redis_url)
    try:
        deadline = time.monotonic() + timeout_s
        while await client.hlen(Keys(namespace).workers()) < n:
            assert time.monotonic() < deadline, "workers did not start"
            await asyncio.sleep(0.05)
    finally:
        await client.aclose()


def sample_traj(batch: str, i: int, *, uid: str = "", response: str = "r", group: str | None = None) -> Trajectory:
    return Trajectory(batch, i, "test/exact", response=f"{response}{i}", ground_truth="1", uid=uid, group=group)


class IdentityScorer:
    """Scores a sample by its identity: index + len(response)/1000 (a wrong sample's result shows)."""

    def __init__(self, delay: float = 0.0, jitter: float = 0.0) -> None:
        self.delay, self.jitter = delay, jitter
        self.seen: list[str] = []

    async def score(self, t: Trajectory) -> Scored:
        self.seen.append(t.uid)
        d = self.delay + random.random() * self.jitter
        if d:
            await asyncio.sleep(d)
        return Scored(t.index + len(t.response) / 1000)


@contextlib.asynccontextmanager
async def identity_worker(url: str, ns: str, scorer=None, **cfg):
    stop = asyncio.Event()
    w = Worker(url, scorer or IdentityScorer(), ConsumerConfig(namespace=ns, block_ms=50, **cfg))
    task = asyncio.ensure_future(w.run(stop))
    try:
        yield w
    finally:
        stop.set()
        await asyncio.wait_for(task, 30)
        await w.aclose()


@contextlib.asynccontextmanager
async def running(url: str, ns: str, scorer, **cfg):
    w = Worker(url, scorer, ConsumerConfig(namespace=ns, block_ms=20, drain_timeout_s=0.3, **cfg))
    async with started(w):
        yield w


async def named_connections(admin, name: str) -> int:
    return sum(1 for c in await admin.client_list() if c.get("name") == name)


async def settle_named(admin, name: str, want: int, within_s: float = 3.0) -> int:
    """The count of connections named ``name`` once it reaches ``want`` (or the last seen)."""
    loop = asyncio.get_running_loop()
    deadline = loop.time() + within_s
    while True:
        n = await named_connections(admin, name)
        if n == want or loop.time() > deadline:
            return n
        await asyncio.sleep(0.05)


def no_unclosed_transports() -> list[str]:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        gc.collect()
        gc.collect()
    return [str(w.message) for w in caught if issubclass(w.category, ResourceWarning)]


async def push_fresh(redis_url: str, namespace: str, *samples: Trajectory) -> None:
    """Push from a new producer (a producer refuses a uid it pushed itself before it asks Redis)."""
    async with RolloutProducer(redis_url, ProducerConfig(namespace=namespace)) as p:
        await p.push_many(samples)


# Its workers read with block_ms=50 and drain within 0.2 s.
quick_worker = functools.partial(running_worker, block_ms=50, drain_timeout_s=0.2)


async def _letter_of_first_sample(client, keys: Keys, group: str = "scorers") -> None:
    """A dead letter for sample 0 of the stream's first entry, as a worker of ``group``
    writes it for a sample of an entry of several (stream_reward.worker.members: Member.fields)."""
    from stream_reward.worker.members import split

    (entry_id, fields), *_ = await client.xrange(keys.stream(), count=1)
    members = split(fields)
    dead = encode_dead_letter(
        reason="poison",
        error="x",
        entry_id=entry_id,
        partition=0,
        consumer="c",
        deliveries=3,
        at=time.time(),
        fields=members[0].fields(fields, len(members), group),
    )
    await client.xadd(keys.dead_letters(0), {"e": dead})


WIDTH = 8


class Exact:
    """1.0 when the response equals the ground truth, else 0.0."""

    async def score(self, traj: Trajectory) -> Scored:
        return Scored(1.0 if traj.response == traj.ground_truth else 0.0)


@contextlib.asynccontextmanager
async def worker(redis_url: str, namespace: str, scorer: Any = None, **cfg: Any) -> AsyncIterator[Worker]:
    w = Worker(
        redis_url, scorer or Exact(), ConsumerConfig(namespace=namespace, block_ms=50, drain_timeout_s=0.2, **cfg)
    )
    stop = asyncio.Event()
    task = asyncio.create_task(w.run(stop))
    try:
        yield w
    finally:
        stop.set()
        await asyncio.wait_for(task, 20)
        await w.aclose()


def samples(batch: str, responses: list[str], truth: str = "a", **kw: Any) -> list[Trajectory]:
    return [
        Trajectory(batch, i, "test", response=r, ground_truth=truth, valid_response_length=i + 1, **kw)
        for i, r in enumerate(responses)
    ]


def traj(batch: str, i: int, *, response: str = "r", **kw: Any) -> Trajectory:
    """Sample ``i`` of ``batch``, answer "1" (kw: uid, group, ...)."""
    return Trajectory(batch, i, "test/exact", response=f"{response}{i}", ground_truth="1", **kw)


async def stream_samples(redis_url: str, producer: RolloutProducer) -> list[tuple[str, int]]:
    """(uid, index) of every sample in the producer's stream, in order."""
    client = connect(redis_url)
    try:
        entries = await client.xrange(producer.keys.stream(0))
    finally:
        await client.aclose()
    return [(t.uid, t.index) for _, fields in entries for t in samples_of(fields)]


async def lane_client_id(lane: Lane) -> int:
    (cid,) = await lane.call([pack_command("CLIENT", "ID")])
    return int(cid)


GOOD = "First 2 * 3 = 6.\n#### 6"


def gsm8k(batch: str, index: int, *, data_source: str = "openai/gsm8k") -> Trajectory:
    return Trajectory(batch, index, data_source, response=GOOD, ground_truth="6", valid_response_length=8)


def ok(batch: str, i: int, score: float, vl: int | None, extra: dict | None = None, uid: str = "") -> ScoreResult:
    return ScoreResult(uid or f"{batch}/{i}", batch, i, score, "ok", extra or {}, valid_response_length=vl)
