"""verl 0.9.1's reward loop through stream-reward: ``StreamRewardLoopManager``.

verl's trainer builds ``RewardLoopManager``, whose ``RewardLoopWorker`` actors call
``load_reward_manager(config, tokenizer, compute_score=..., reward_router_address=...,
reward_model_tokenizer=...)`` and then ``await manager.run_single(data[i:i+1])`` per
sample (the agent loop calls the same worker as each rollout finishes); the class's
``assemble_rm_scores(data, scores)`` builds rm_scores. A user switches with three
overrides and nothing else::

    reward.reward_manager.source=importlib
    reward.reward_manager.module.path=pkg://stream_reward.verl
    reward.reward_manager.name=StreamRewardLoopManager

Options come from verl's own keys only (``reward.custom_reward_function``,
``reward.reward_kwargs``, see ``verl_options.LoopOptions``); the rest of verl's config is never
read, so it never reaches a scorer or a worker's command line, and a ``???`` left
elsewhere in it does no harm. verl's ``compute_score`` argument is not used either:
the worker processes load the function themselves, from the same config keys.

Where the worker processes run: see ``stream_reward.verl.server``.

verl itself is never imported here: a DataProto is read through ``data.batch``,
``data.non_tensor_batch``; the config through ``.get``.
"""

from __future__ import annotations

import asyncio
import atexit
import collections
import contextlib
import dataclasses
import logging
import threading
import uuid
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from stream_reward.config import ManagerConfig, ProducerConfig
from stream_reward.errors import ConfigError, StreamRewardError
from stream_reward.scoring.registry import build_scorer
from stream_reward.trainer.aggregator import RewardAggregator
from stream_reward.trainer.loop_thread import LoopThread
from stream_reward.verl.columns import VerlColumns, declared_columns
from stream_reward.verl.options import LoopOptions
from stream_reward.verl.prompts import reads_prompts, row_prompt
from stream_reward.wire.codec import to_plain
from stream_reward.wire.connection import cancel_until_done
from stream_reward.wire.trajectory import ScoreResult, Trajectory, default_uid

__all__ = ["StreamRewardLoopManager", "decode_row"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# How often one sample goes again after its server was replaced (the shared actor died).
_RECOVERIES = 2
_WATCH_S = 1.0  # how often a window in flight asks whether its pipeline is gone


class StreamRewardLoopManager:
    """A verl 0.9.1 reward-loop manager whose scoring runs on stream-reward workers.

    Constructed by verl's ``load_reward_manager`` exactly as its own managers are;
    ``compute_score`` (verl's resolved function) is accepted and not used: the
    workers load the same function from the config keys it came from.
    """

    def __init__(
        self,
        config: Any,
        tokenizer: Any,
        compute_score: Any = None,
        reward_router_address: str | None = None,
        reward_model_tokenizer: Any = None,
        **_unused: Any,
    ) -> None:
        from stream_reward.verl.server import attach

        self.config = config
        self.tokenizer = tokenizer
        self.reward_router_address = reward_router_address
        self.options = LoopOptions.from_verl(config, reward_router_address=reward_router_address)
        # A bad option fails here, in the trainer, with its key named; not in every worker.
        _check_buildable(self.options.manager)
        self._prefix = f"verl-{uuid.uuid4().hex[:12]}"
        self._counter = 0
        self._windows = _Windows(self)
        self._inbox: collections.deque[tuple[Any, asyncio.AbstractEventLoop, asyncio.Future[Any]]] = collections.deque()
        self._drain_scheduled = False
        self._reads_prompts = reads_prompts(self.options.manager)
        # The same reward_extra_info keys on every sample of every RewardLoopWorker actor.
        self._columns = VerlColumns(
            declared_columns(self.options.manager, self.options.extra_keys),
            composite=bool(self.options.manager.components),
        )
        # One private loop per manager owns its Redis clients: run_single may be awaited
        # from any loop (a Ray actor's, an agent loop's, successive asyncio.run calls).
        self._loop_thread = LoopThread("stream-reward-verl")
        self._loop = self._loop_thread.loop
        self._closed = False
        self._producer: Any = None
        self._aggregator: RewardAggregator | None = None
        self._recovering: asyncio.Lock | None = None  # made on the manager's loop, where it is used
        try:
            self._placement = attach(self.options)
        except BaseException:
            self._stop_loop()
            raise
        atexit.register(self.close)

    # ------------------------------------------------------------ verl's interface
    async def run_single(self, data: Any) -> dict[str, Any]:
        """Score the last row of ``data``: ``{"reward_score", "reward_extra_info"}``."""
        if self._closed:
            raise StreamRewardError("StreamRewardLoopManager is closed")
        loop = asyncio.get_running_loop()
        future: asyncio.Future[dict[str, Any]] = loop.create_future()
        self._inbox.append((data, loop, future))
        # One wake-up of the manager's loop per burst of calls, not one per call: the
        # flag is cleared by the drain before it takes the inbox, so a call appended
        # after that take always schedules another drain.
        if not self._drain_scheduled:
            self._drain_scheduled = True
            self._loop.call_soon_threadsafe(self._drain)
        return await future

    @classmethod
    def assemble_rm_scores(cls, data: Any, scores: list[float]) -> Any:
        """rm_scores as verl 0.9.1 lays them out: each score at ``valid_response_length - 1``.

        A zero-length response's score lands at index -1, the last column, as in verl:
        ``token_level_rewards.sum(-1)`` counts it in GRPO group statistics, and a zero
        row there would change training.
        """
        import torch

        prompt_length = data.batch["prompts"].size(1)
        valid = data.batch["attention_mask"][:, prompt_length:].sum(dim=1)
        rm_scores = torch.zeros_like(data.batch["responses"], dtype=torch.float32)
        rows = torch.arange(rm_scores.size(0), device=rm_scores.device)
        rm_scores[rows, valid - 1] = rm_scores.new_tensor([float(s) for s in scores])
        return rm_scores

    # ------------------------------------------------------------ lifecycle
    @property
    def redis_url(self) -> str:
        return self._placement.url

    def close(self) -> None:
        """Close this manager's clients and release its server (idempotent)."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        with contextlib.suppress(Exception):
            asyncio.run_coroutine_threadsafe(self._aclose_clients(), self._loop).result(timeout=10)
        self._stop_loop()
        self._placement.release()

    def _stop_loop(self) -> None:
        self._loop_thread.stop()

    async def _aclose_clients(self) -> None:
        # Windows still finishing (their last step expires the batch's keys) get a
        # moment; what is left is cancelled, not destroyed pending with the loop.
        tasks = set(self._windows._tasks)
        if tasks:
            _, pending = await asyncio.wait(tasks, timeout=5.0)
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
        if self._producer is not None:
            await self._producer.aclose()
        if self._aggregator is not None:
            await self._aggregator.aclose()

    # ------------------------------------------------------------ on the private loop
    def _clients(self) -> tuple[Any, RewardAggregator]:
        if self._producer is None:
            from stream_reward.trainer.producer import RolloutProducer

            namespace = self.options.namespace
            self._producer = RolloutProducer(self._placement.url, ProducerConfig(namespace=namespace))
            self._aggregator = RewardAggregator(self._placement.url, namespace=namespace)
        assert self._aggregator is not None
        return self._producer, self._aggregator

    async def _recover(self, failed_url: str) -> bool:
        """After a window failed on ``failed_url``: True when the samples can go again, to
        a server that replaced it (re-attached once for every window that failed on it)."""
        if self._recovering is None:
            self._recovering = asyncio.Lock()
        async with self._recovering:
            if self._placement.url != failed_url:
                return True  # another window re-attached already
            url = await asyncio.to_thread(self._placement.recover)
            if url is None or url == failed_url:
                return False
            self._placement.url = url
            old = [client for client in (self._producer, self._aggregator) if client is not None]
            self._producer = self._aggregator = None
        for client in old:  # connected to a server that is gone: nothing to flush
            with contextlib.suppress(Exception):
                await asyncio.wait_for(client.aclose(), timeout=2.0)
        return True

    def _new_batch_id(self) -> str:
        self._counter += 1
        return f"{self._prefix}-{self._counter}"

    def _drain(self) -> None:
        """On the manager's loop: decode every call that arrived and hand it to the adapter."""
        self._drain_scheduled = False
        inbox = self._inbox
        while inbox:
            data, caller_loop, future = inbox.popleft()
            try:
                traj = decode_row(
                    data,
                    self.tokenizer,
                    self._prefix,
                    verl_manager=self.options.manager.manager,
                    with_prompt=self._reads_prompts,
                )
            except Exception as exc:  # bad input: the caller gets the precise error
                failed: list[tuple[asyncio.Future[Any], Any, BaseException | None]] = [(future, None, exc)]
                caller_loop.call_soon_threadsafe(_settle, failed)
                continue
            _submit(self, traj, _Reply(caller_loop, future))

    def _deliver(self, replies: list[tuple[_Reply, ScoreResult | BaseException]]) -> None:
        """Results to their callers, one hop per caller loop for the whole list."""
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[Any, Any, BaseException | None]]] = {}
        errors = [outcome for _, outcome in replies if isinstance(outcome, BaseException)]
        if errors:
            # The pipeline failed these samples (Redis down, every worker gone): run_single
            # raises, and verl fails its step. A 0.0 would reach rm_scores as a score, and
            # verl would train on it.
            log.error("%d samples not scored: %s", len(errors), errors[0])
        for reply, outcome in replies:
            item: tuple[Any, Any, BaseException | None]
            if isinstance(outcome, BaseException):
                item = (reply.future, None, outcome)
            else:
                item = (reply.future, self._verl_result(outcome), None)
            by_loop.setdefault(reply.loop, []).append(item)
        for caller_loop, items in by_loop.items():
            with contextlib.suppress(RuntimeError):  # a caller loop already closed: nobody waits
                caller_loop.call_soon_threadsafe(_settle, items)

    def _verl_result(self, result: ScoreResult) -> dict[str, Any]:
        """verl's per-sample dict, its ``reward_extra_info`` holding exactly the declared
        columns (``stream_reward.verl.columns``): ``score``, ``acc``, ``reward_failed``,
        ``reward_status`` and the scorer's, None where a sample has none."""
        extra = dict(result.extra)
        if result.status == "ok":
            score = float(result.score)
            base = set(extra) - {"overlong_reward", "overlong"}  # dapo's shaping columns
            if not base or (base == {"acc"} and self.options.manager.manager == "dapo"):
                task = score - float(extra.get("overlong_reward") or 0.0)
                extra.setdefault("acc", task)  # verl's naive / DAPO log a bare-number score as acc
            else:
                # A dict result: verl logs its own keys, "score" (the task score) included.
                task = score - float(extra.get("overlong_reward") or 0.0)
                extra = {"score": task, **extra}
            extra.setdefault("score", task)
            extra.setdefault("acc", task)
            extra["reward_failed"] = 0.0
            extra["reward_status"] = "ok"
        else:
            policy = self.options.policy
            score = policy.fallback_score if policy.on_failure == "fallback" else 0.0
            # What the scorer knew all the same (a composite's columns) stays on the failed sample.
            extra.update(score=score, acc=score, reward_failed=1.0, reward_status=result.reason or "failed")
            log.warning("sample %s failed (%s): %s", result.uid, result.reason, result.error)
        return {"reward_score": score, "reward_extra_info": self._columns.conform(extra)}


@dataclasses.dataclass(frozen=True)
class _Reply:
    """Where one sample's result goes: a future on the caller's loop."""

    loop: asyncio.AbstractEventLoop
    future: asyncio.Future[dict[str, Any]]


def _settle(items: list[tuple[asyncio.Future[Any], Any, BaseException | None]]) -> None:
    """On a caller's loop: resolve its futures (skipping callers that gave up)."""
    for future, value, error in items:
        if future.done():
            continue
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)


def _submit(manager: StreamRewardLoopManager, traj: Trajectory, reply: _Reply) -> None:
    """Push one sample; its result (or a StreamRewardError) goes to ``reply``."""
    manager._windows.submit(traj, reply)


class _Windows:
    """The per-sample path. A sample must belong to an open batch, and verl's run_single
    has none: the samples that arrive within ``window_s`` of each other become one batch
    (one open_batch, one push_many, which the producer coalesces with other pushes).
    One reader follows that batch's results (``aggregator.stream``) and each result
    goes back as it lands; results that land together go back in one hop per caller
    loop.

    Why not ``producer.score(traj)`` per sample, with the process's one listener: it
    costs a task, a push and a listener future per sample, and with 1,024 samples in
    flight those survive into CPython's oldest generation; measured in ``bench
    verl_loop``, full collections of a verl process's ~480k objects (250-550 ms each)
    then land on our rounds three times as often. A reader per window costs nothing
    per sample."""

    def __init__(self, manager: StreamRewardLoopManager, *, window_s: float = 0.002, max_size: int = 4096) -> None:
        self._manager = manager
        self._window_s = window_s
        self._max_size = max_size
        self._pending: list[tuple[Trajectory, _Reply]] = []
        self._flush_handle: asyncio.TimerHandle | None = None
        self._tasks: set[asyncio.Task[None]] = set()  # strong references until each window ends
        self._ready: list[tuple[_Reply, ScoreResult | BaseException]] = []

    def submit(self, traj: Trajectory, reply: _Reply) -> None:
        self._pending.append((traj, reply))
        if len(self._pending) >= self._max_size:
            self._flush()
        elif self._flush_handle is None:
            self._flush_handle = asyncio.get_running_loop().call_later(self._window_s, self._flush)

    def _flush(self) -> None:
        if self._flush_handle is not None:
            self._flush_handle.cancel()
            self._flush_handle = None
        window, self._pending = self._pending, []
        if window:
            task = asyncio.ensure_future(self._send(window))
            self._tasks.add(task)
            task.add_done_callback(self._tasks.discard)

    def _reply(self, reply: _Reply, outcome: ScoreResult | BaseException) -> None:
        # The reader yields a page of results without suspending in between: gather
        # them and send them back together at the end of this loop turn.
        if not self._ready:
            asyncio.get_running_loop().call_soon(self._send_ready)
        self._ready.append((reply, outcome))

    def _send_ready(self) -> None:
        ready, self._ready = self._ready, []
        if ready:
            self._manager._deliver(ready)

    async def _send(self, window: list[tuple[Trajectory, _Reply]]) -> None:
        manager = self._manager
        for attempt in range(_RECOVERIES + 1):
            url = manager._placement.url
            replies: list[_Reply | None] = [reply for _, reply in window]
            try:
                await self._score([traj for traj, _ in window], replies)
                return
            except Exception as exc:
                failure = (
                    exc if isinstance(exc, StreamRewardError) else StreamRewardError(f"{type(exc).__name__}: {exc}")
                )
            # What was not answered yet goes again, to a new server, if the one it went to
            # was replaced (the job's shared actor died and a new one runs).
            window = [(traj, reply) for (traj, _), reply in zip(window, replies) if reply is not None]
            if not window:
                return
            if attempt < _RECOVERIES:
                try:
                    if await manager._recover(url):
                        log.warning("re-sending %d samples to the new server", len(window))
                        continue
                except StreamRewardError as exc:
                    failure = StreamRewardError(f"{failure}; and {exc}")
            manager._deliver([(reply, failure) for _, reply in window])
            return

    async def _score(self, window: list[Trajectory], replies: list[_Reply | None]) -> None:
        """One batch: push ``window``, answer each reply as its result lands (setting it
        to None); raises when the pipeline fails under it."""
        manager = self._manager
        producer, aggregator = manager._clients()
        batch_id = manager._new_batch_id()
        trajs = [
            dataclasses.replace(traj, batch_id=batch_id, index=i, uid=default_uid(batch_id, i))
            for i, traj in enumerate(window)
        ]
        width = max(traj.max_response_length or 1 for traj in trajs)
        await producer.open_batch(batch_id, len(trajs), width, policy=manager.options.policy)
        await producer.push_many(trajs)
        follow = asyncio.ensure_future(self._follow(aggregator, batch_id, replies))
        watch = asyncio.ensure_future(_watch_placement(manager))
        try:
            await asyncio.wait({follow, watch}, return_when=asyncio.FIRST_COMPLETED)
            if not follow.done():
                raise StreamRewardError(watch.result())
            follow.result()
        finally:
            # The follow is mostly inside a blocking read, where a cancel can be swallowed.
            await cancel_until_done((follow, watch))
            self._send_ready()
        # The stream ends at the batch deadline with samples missing.
        for i, reply in enumerate(replies):
            if reply is not None:
                replies[i] = None
                error = "no result before the batch deadline"
                self._reply(
                    reply, ScoreResult(trajs[i].uid, batch_id, i, 0.0, "failed", reason="deadline", error=error)
                )
        self._send_ready()
        # Every sample is answered, and nobody collects this batch again: its results go
        # now (a window of one trajectory otherwise kept ~4.6 KB for collected_ttl_s).
        await aggregator.forget(batch_id)

    async def _follow(self, aggregator: RewardAggregator, batch_id: str, replies: list[_Reply | None]) -> None:
        async for result in aggregator.stream(batch_id):
            if 0 <= result.index < len(replies) and (reply := replies[result.index]) is not None:
                replies[result.index] = None
                self._reply(reply, result)


async def _watch_placement(manager: StreamRewardLoopManager) -> str:
    """Returns why the pipeline is gone: every local worker process exited (a bad scorer,
    a crash at start), or the job's shared actor died."""
    while (cause := manager._placement.lost()) is None:
        await asyncio.sleep(_WATCH_S)
    return cause


def _check_buildable(config: ManagerConfig) -> None:
    async def build() -> None:
        # The workers fill in their own Redis URL; building connects to nothing, so a
        # placeholder lets a quota-holding scorer be checked here too.
        scorer = build_scorer(dataclasses.replace(config, redis_url=config.redis_url or "redis://127.0.0.1:9"))
        close = getattr(scorer, "aclose", None)
        if close is not None:
            await close()

    # Always on a thread of its own: asyncio.run here would clear this thread's current
    # event loop, the one verl's RewardLoopWorker takes with get_event_loop() right after.
    _run_in_thread(build())


def _run_in_thread(coro: Coroutine[Any, Any, T]) -> T:
    out: dict[str, Any] = {}

    def target() -> None:
        try:
            out["value"] = asyncio.run(coro)
        except BaseException as exc:  # re-raised in the caller's thread
            out["error"] = exc

    thread = threading.Thread(target=target)
    thread.start()
    thread.join()
    if "error" in out:
        raise out["error"]
    return out["value"]


# ---------------------------------------------------------------- decoding
def decode_row(
    data: Any, tokenizer: Any, batch_id: str, *, verl_manager: str = "naive", with_prompt: bool = False
) -> Trajectory:
    """The last row of a DataProto as a trajectory, decoded as verl 0.9.1's reward-loop
    managers decode it (``naive.py`` / ``dapo.py``); its prompt is the last user
    message (``stream_reward.verl.prompts``), the ids decoded only ``with_prompt``."""
    batch = data.batch
    nt = data.non_tensor_batch
    responses = batch["responses"][-1]
    width = int(responses.shape[-1])
    valid = int(batch["attention_mask"][-1][-width:].sum())
    response = tokenizer.decode(responses[:valid], skip_special_tokens=True)
    # The question as the dataset asked it (the sandbox's checker takes a test's helpers
    # from it, a judge reads it); the ids are decoded only for a scorer that reads it.
    prompts = batch["prompts"][-1]
    prompt_valid = int(batch["attention_mask"][-1][: prompts.shape[-1]].sum()) if with_prompt else 0
    prompt = row_prompt(
        _last(nt, "raw_prompt"), prompts[prompts.shape[-1] - prompt_valid :], tokenizer, decode=with_prompt
    )
    reward_model = to_plain(_last(nt, "reward_model")) or {}
    extra = to_plain(_last(nt, "extra_info")) or {}
    if not isinstance(extra, dict):
        raise ConfigError("extra_info", f"must be a dict, got {type(extra).__name__}")
    extra = dict(extra)
    if verl_manager != "dapo":  # verl's naive adds these; its DAPO manager does not
        tool_fields = to_plain(_last(nt, "tool_extra_fields"))
        if isinstance(tool_fields, Mapping):
            extra.update(tool_fields)
        extra["num_turns"] = to_plain(_last(nt, "__num_turns__"))
        extra["rollout_reward_scores"] = to_plain(_last(nt, "reward_scores")) or {}
    group = _last(nt, "uid")
    return Trajectory(
        batch_id=batch_id,
        index=0,
        data_source=str(to_plain(nt["data_source"][-1])),
        response=response,
        ground_truth=reward_model.get("ground_truth") if isinstance(reward_model, dict) else None,
        prompt=prompt,
        valid_response_length=valid,
        max_response_length=width,
        extra_info=extra,
        group=str(to_plain(group)) if group is not None else None,
    )


def _last(nt: Mapping[str, Any], key: str) -> Any:
    column = nt.get(key)
    return None if column is None else column[-1]
