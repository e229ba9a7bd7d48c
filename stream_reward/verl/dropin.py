"""A verl reward manager that scores through the stream-reward pipeline.

``StreamRewardManager`` takes the arguments of verl's managers and is called the
same way (``manager(data, return_dict=False)`` on a DataProto), but each batch
goes producer -> worker processes -> aggregator. verl itself is never imported:
a DataProto is read through ``data.batch[...]``, ``data.non_tensor_batch[...]``
and ``data.meta_info``.

Three ways in:

* ``manager(data, return_dict=False)`` — verl's legacy reward-manager call: the
  reward tensor, or ``{"reward_tensor", "reward_extra_info"}``;
* ``compute_rm_score(data)`` — verl's reward loop: ``{"rm_scores",
  "reward_extra_keys", "reward_extra_info", "meta_info"}`` (numpy columns),
  ready for ``DataProto.from_dict(tensors={"rm_scores": ...},
  non_tensors=..., meta_info=...)``. A batch carrying those rm_scores and that
  meta_info is returned as is by ``manager(data)``, never shaped twice;
* ``open_batch`` + ``await push_sample(batch_id, index, item)`` from the agent
  loop as each rollout finishes, then ``collect_rm_score(batch_id)`` in the
  trainer: scoring overlaps generation.

Decoding follows verl's NaiveRewardManager: prompts are left-padded, responses
right-padded, ``valid_response_length = attention_mask[prompt_len:].sum()``,
``tokenizer.decode(..., skip_special_tokens=True)``; with ``manager="dapo"`` a
trailing eos token string is stripped, as DAPORewardManager does. A sample's prompt
is the last user message: of ``raw_prompt`` when the batch carries it, else of the
decoded prompt ids with the chat template undone (``stream_reward.verl.prompts``).

Deliberate differences from verl: a zero-length response gets no reward (its
row stays zero; verl writes the score at index -1, the last padding column);
``reward_extra_info`` has the union of keys over the batch with ``None`` where
a sample did not report a key (verl misaligns or drops such columns); a
failed sample (timeout, crash) scores 0 in the tensor, as verl's timeouts do,
and is marked in ``last_rewards.valid`` / ``.status``.
"""

from __future__ import annotations

import asyncio
import atexit
import contextlib
import functools
import itertools
import json
import logging
import sys
import uuid
from collections.abc import Coroutine, Mapping
from typing import Any, TypeVar

from stream_reward.config import BatchPolicy, ManagerConfig, ProducerConfig
from stream_reward.errors import ConfigError, StreamRewardError
from stream_reward.ops.pipeline import LocalPipeline
from stream_reward.scoring.registry import build_scorer
from stream_reward.trainer.aggregator import RewardAggregator
from stream_reward.trainer.loop_thread import LoopThread
from stream_reward.trainer.producer import RolloutProducer
from stream_reward.trainer.rewards import BatchRewards
from stream_reward.trainer.tensors import import_numpy
from stream_reward.verl.prompts import row_prompt
from stream_reward.wire.codec import to_plain
from stream_reward.wire.connection import cancel_until_done
from stream_reward.wire.keys import DEFAULT_NAMESPACE
from stream_reward.wire.trajectory import Trajectory

__all__ = ["StreamRewardManager", "scorer_spec", "decode_batch", "FINAL_SCORES_KEY"]

log = logging.getLogger(__name__)

T = TypeVar("T")

# ManagerConfig fields a caller sets through the constructor's own arguments.
_RESERVED = {"manager": "manager", "scorer": "compute_score", "redis_url": "redis_url", "namespace": "namespace"}
_ALIASES = {"compute_score_timeout": "timeout"}  # NaiveRewardManager's name for the per-sample timeout
_IGNORED = {"num_examine"}  # verl prints that many samples; we log nothing per sample
# meta_info flag on rm_scores this manager returned: already final (shaped), never re-scored.
FINAL_SCORES_KEY = "stream_reward_final"


class StreamRewardManager:
    """verl's reward-manager interface over worker processes.

    ``compute_score``: None (the built-in rules, like verl's
    default_compute_score), a spec string (``module.path:func``,
    ``file.py:func``, ``http:URL``, ``sandbox``, ...), or a function the worker
    processes can import by name (top-level in an importable module or file;
    verl's ``get_custom_reward_fn`` partials are unwrapped).

    ``manager_kwargs`` take verl's keys (``overlong_buffer_cfg``,
    ``max_resp_len``, ``max_rpm``, ``timeout``/``compute_score_timeout``, ...,
    see ``ManagerConfig``); ``num_examine`` is ignored; any other key is passed
    to compute_score, as verl's BatchRewardManager passes its ``reward_kwargs``.

    With ``redis_url=None`` a private server and ``num_workers`` (default 2)
    local worker processes are started, and stopped by ``close()``. With a URL,
    workers are expected to be running already (``stream-reward worker``) unless
    ``num_workers`` asks for local ones.
    """

    def __init__(
        self,
        tokenizer: Any,
        compute_score: Any = None,
        reward_fn_key: str = "data_source",
        manager: str = "naive",
        redis_url: str | None = None,
        namespace: str | None = None,
        *,
        num_workers: int | None = None,
        worker_args: list[str] | tuple[str, ...] = (),
        policy: BatchPolicy | None = None,
        collect_timeout_s: float | None = None,
        **manager_kwargs: Any,
    ) -> None:
        self.tokenizer = tokenizer
        self.reward_fn_key = reward_fn_key
        self.manager = manager
        self.namespace = namespace or DEFAULT_NAMESPACE
        self.policy = policy or BatchPolicy()
        if self.policy.on_failure == "drop":
            raise ConfigError(
                "policy", "'drop' removes rows, but verl needs one reward row per sample; use 'mask' or 'fallback'"
            )
        self.collect_timeout_s = collect_timeout_s
        self.last_rewards: BatchRewards | None = None

        if "config" in manager_kwargs or "reward_router_address" in manager_kwargs:
            # verl 0.9.1's load_reward_manager(config, tokenizer, ...) built this class:
            # its reward loop calls run_single, which the batch drop-in does not have.
            raise ConfigError(
                "reward.reward_manager.name",
                "StreamRewardManager is the batch-call drop-in; verl's reward loop needs "
                "reward.reward_manager.name=StreamRewardLoopManager",
            )
        spec, fn_kwargs = scorer_spec(compute_score)
        options = _manager_options(manager_kwargs, fn_kwargs)
        self.config = ManagerConfig(manager=manager, scorer=spec, **options)
        if num_workers is None:
            num_workers = 2 if redis_url is None else 0
        if redis_url is None and num_workers < 1:
            raise ConfigError("num_workers", "an embedded server needs local workers (num_workers >= 1)")
        args = ["--manager", manager, "--scorer", spec, "--manager-kwargs", json.dumps(options), *worker_args]
        self._pipeline = LocalPipeline(redis_url, processes=num_workers, namespace=self.namespace, worker_args=args)
        self._batch_prefix = f"verl-{uuid.uuid4().hex[:10]}"
        self._counter = itertools.count()
        self._producer: RolloutProducer | None = None
        self._aggregator: RewardAggregator | None = None

        # One private loop owns every Redis client; sync and async callers both go through it.
        self._thread = LoopThread("stream-reward-verl")
        self._closed = False
        try:
            # Build the scorer once here, so that a bad option fails in the trainer
            # with its key named, not in every worker process.
            self._run(_check_buildable(self.config))
            self._pipeline.start()
        except BaseException:
            self.close()
            raise
        atexit.register(self.close)

    # ------------------------------------------------------------ lifecycle
    @property
    def redis_url(self) -> str:
        return self._pipeline.url

    def close(self) -> None:
        """Stop the local workers and the embedded server (if any); idempotent."""
        if self._closed:
            return
        self._closed = True
        atexit.unregister(self.close)
        with contextlib.suppress(Exception):
            self._thread.run(self._aclose_clients(), timeout_s=10)
        self._thread.stop()
        self._pipeline.stop()

    def __enter__(self) -> StreamRewardManager:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    async def _aclose_clients(self) -> None:
        if self._producer is not None:
            await self._producer.aclose()
        if self._aggregator is not None:
            await self._aggregator.aclose()

    def _run(self, coro: Coroutine[Any, Any, T]) -> T:
        if self._closed:
            coro.close()
            raise StreamRewardError("StreamRewardManager is closed")
        return self._thread.run(coro)

    async def _arun(self, coro: Coroutine[Any, Any, T]) -> T:
        # Every Redis client lives on the manager's own loop; callers on any other
        # loop (an agent loop, a Ray actor) wait for it without blocking theirs.
        if self._closed:
            coro.close()
            raise StreamRewardError("StreamRewardManager is closed")
        return await asyncio.wrap_future(asyncio.run_coroutine_threadsafe(coro, self._thread.loop))

    def _clients(self) -> tuple[RolloutProducer, RewardAggregator]:
        if self._producer is None:
            self._producer = RolloutProducer(self.redis_url, ProducerConfig(namespace=self.namespace))
            self._aggregator = RewardAggregator(self.redis_url, namespace=self.namespace)
        assert self._aggregator is not None
        return self._producer, self._aggregator

    def new_batch_id(self) -> str:
        return f"{self._batch_prefix}-{next(self._counter)}"

    # ------------------------------------------------------------ verl's legacy call
    def __call__(self, data: Any, return_dict: bool = False) -> Any:
        """verl's reward-manager call: the ``[batch, response_len]`` float32 reward
        tensor, or ``{"reward_tensor", "reward_extra_info"}`` with ``return_dict``."""
        if _already_final(data):
            tensor = data.batch["rm_scores"]
            return (
                {"reward_tensor": tensor, "reward_extra_info": _with_upstream_extras({}, data)}
                if return_dict
                else tensor
            )
        rewards = self._run(self._score(data))
        tensor = rewards.rm_scores.to(data.batch["responses"].device)
        if not return_dict:
            return tensor
        return {"reward_tensor": tensor, "reward_extra_info": _with_upstream_extras(rewards.reward_extra_info, data)}

    # ------------------------------------------------------------ verl's reward loop
    def compute_rm_score(self, data: Any) -> dict[str, Any]:
        """The batch through the pipeline, returned the way verl's reward loop
        returns it: ``rm_scores``, ``reward_extra_keys`` and their numpy columns."""
        rewards = self._run(self._score(data))
        return _loop_output(
            rewards, _with_upstream_extras(rewards.reward_extra_info, data), data.batch["responses"].device
        )

    async def acompute_rm_score(self, data: Any) -> dict[str, Any]:
        rewards = await self._arun(self._score(data))
        return _loop_output(
            rewards, _with_upstream_extras(rewards.reward_extra_info, data), data.batch["responses"].device
        )

    # ------------------------------------------------------------ per sample (agent loop)
    def open_batch(self, batch_id: str, size: int, response_len: int) -> None:
        """Declare a batch whose samples ``push_sample`` will send one by one."""
        self._run(self._open(batch_id, size, response_len))

    async def aopen_batch(self, batch_id: str, size: int, response_len: int) -> None:
        await self._arun(self._open(batch_id, size, response_len))

    async def push_sample(self, batch_id: str, index: int, item: Any) -> None:
        """Send one finished rollout (a one-row DataProto, e.g. ``data[i:i+1]``)
        to be scored now, as sample ``index`` of ``batch_id``."""
        traj = decode_batch(
            item,
            self.tokenizer,
            batch_id,
            reward_fn_key=self.reward_fn_key,
            strip_eos=self.manager == "dapo",
            first_index=index,
        )[-1]
        await self._arun(self._push([traj]))

    def collect_rm_score(self, batch_id: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        """Wait for every sample of ``batch_id``; the reward loop's output (see ``compute_rm_score``)."""
        rewards = self._run(self._collect(batch_id, timeout_s))
        return _loop_output(rewards, rewards.reward_extra_info, None)

    async def acollect_rm_score(self, batch_id: str, *, timeout_s: float | None = None) -> dict[str, Any]:
        rewards = await self._arun(self._collect(batch_id, timeout_s))
        return _loop_output(rewards, rewards.reward_extra_info, None)

    # ------------------------------------------------------------ on the manager's loop
    async def _open(self, batch_id: str, size: int, response_len: int) -> None:
        producer, _ = self._clients()
        await producer.open_batch(batch_id, size, response_len, policy=self.policy)

    async def _push(self, trajs: list[Trajectory]) -> None:
        producer, _ = self._clients()
        await producer.push_many(trajs)

    async def _score(self, data: Any) -> BatchRewards:
        batch_id = self.new_batch_id()
        trajs = decode_batch(
            data, self.tokenizer, batch_id, reward_fn_key=self.reward_fn_key, strip_eos=self.manager == "dapo"
        )
        await self._open(batch_id, len(trajs), int(data.batch["responses"].shape[-1]))
        await self._push(trajs)
        return await self._collect(batch_id, self.collect_timeout_s)

    async def _collect(self, batch_id: str, timeout_s: float | None) -> BatchRewards:
        _, aggregator = self._clients()
        task = asyncio.ensure_future(aggregator.collect(batch_id, timeout_s=timeout_s))
        workers = self._pipeline.workers
        try:
            while True:
                done, _ = await asyncio.wait({task}, timeout=0.5)
                if done:
                    break
                # Local workers that all died (a bad scorer spec, a crash at start)
                # would leave the trainer waiting forever: say so instead.
                codes = [proc.poll() for proc in workers]
                if workers and all(code is not None for code in codes):
                    raise StreamRewardError(
                        f"every local worker process exited (exit codes {codes}); "
                        f"batch {batch_id!r} cannot be scored — see the workers' stderr"
                    )
        finally:
            # A cancel that lands inside a redis-py command can be swallowed on Python
            # 3.11, and a plain ``await task`` would then wait out a collect without timeout.
            await cancel_until_done((task,))
        rewards = task.result()
        # The producer remembers every uid it pushed per batch id (to refuse
        # duplicates) and never forgets a batch; a training run opens one per step.
        if self._producer is not None:
            self._producer._seen.pop(batch_id, None)
        self.last_rewards = rewards
        return rewards


# ---------------------------------------------------------------- decoding
def decode_batch(
    data: Any,
    tokenizer: Any,
    batch_id: str,
    *,
    reward_fn_key: str = "data_source",
    strip_eos: bool = False,
    first_index: int = 0,
) -> list[Trajectory]:
    """Trajectories from a DataProto-like batch, decoded as verl's NaiveRewardManager does."""
    prompts = data.batch["prompts"]
    responses = data.batch["responses"]
    mask = data.batch["attention_mask"]
    prompt_len = prompts.shape[-1]
    prompt_lengths = mask[:, :prompt_len].sum(-1).tolist()
    response_lengths = mask[:, prompt_len:].sum(-1).tolist()
    nt = data.non_tensor_batch
    precomputed = data.batch["rm_scores"] if _has_key(data.batch, "rm_scores") else None
    eos = getattr(tokenizer, "eos_token", None) if strip_eos else None
    out = []
    for i in range(responses.shape[0]):
        vpl, vrl = int(prompt_lengths[i]), int(response_lengths[i])
        prompt = row_prompt(_column(nt, "raw_prompt", i), prompts[i][prompt_len - vpl :], tokenizer, decode=True)
        response = tokenizer.decode(responses[i][:vrl], skip_special_tokens=True)
        if eos and response.endswith(eos):
            response = response[: -len(eos)]
        reward_model = _plain(_column(nt, "reward_model", i)) or {}
        extra = _plain(_column(nt, "extra_info", i)) or {}
        if not isinstance(extra, dict):
            raise ConfigError("extra_info", f"sample {i}: extra_info must be a dict, got {type(extra).__name__}")
        extra = dict(extra)  # verl adds these keys to the caller's dict in place; we copy first
        extra["num_turns"] = _plain(_column(nt, "__num_turns__", i))
        extra["rollout_reward_scores"] = _plain(_column(nt, "reward_scores", i)) or {}
        group = _column(nt, "uid", i)
        out.append(
            Trajectory(
                batch_id=batch_id,
                index=first_index + i,
                data_source=str(_plain(nt[reward_fn_key][i])),
                response=response,
                ground_truth=reward_model.get("ground_truth") if isinstance(reward_model, dict) else None,
                prompt=prompt,
                valid_response_length=vrl,
                max_response_length=int(responses.shape[-1]),
                extra_info=extra,
                group=str(_plain(group)) if group is not None else None,
                rm_score=float(precomputed[i].sum()) if precomputed is not None else None,
            )
        )
    return out


def _has_key(batch: Any, key: str) -> bool:
    keys = getattr(batch, "keys", None)
    return key in (keys() if callable(keys) else batch)


def _column(nt: Mapping[str, Any], key: str, i: int) -> Any:
    column = nt.get(key)
    return None if column is None else column[i]


def _plain(value: Any) -> Any:
    """numpy / torch / OmegaConf values as the plain Python msgpack and JSON carry."""
    return to_plain(value, unknown=_sequence_or_self)


def _sequence_or_self(value: Any) -> Any:
    # OmegaConf's ListConfig and other sized iterables become lists; anything else stays.
    if hasattr(value, "__iter__") and hasattr(value, "__len__"):
        return [_plain(v) for v in value]
    return value


def _with_upstream_extras(extras: dict[str, list[Any]], data: Any) -> dict[str, list[Any]]:
    """Columns an upstream reward loop already put on the batch (``meta_info["reward_extra_keys"]``) stay."""
    keys = (getattr(data, "meta_info", None) or {}).get("reward_extra_keys") or []
    if not keys:
        return extras
    merged = dict(extras)
    for key in keys:
        if key in data.non_tensor_batch:
            merged[key] = _plain(data.non_tensor_batch[key])
    return merged


def _already_final(data: Any) -> bool:
    """rm_scores this manager produced (``compute_rm_score``'s meta_info travelled
    with them): final, shaping included. Scoring them again would shape twice."""
    meta = getattr(data, "meta_info", None) or {}
    return bool(meta.get(FINAL_SCORES_KEY)) and _has_key(data.batch, "rm_scores")


def _loop_output(rewards: BatchRewards, extras: dict[str, list[Any]], device: Any) -> dict[str, Any]:
    np = import_numpy()

    columns = {}
    for key, values in extras.items():
        column = np.empty(len(values), dtype=object)
        column[:] = values
        if all(v is not None for v in values):
            try:
                column = np.array(values)
                if column.ndim != 1:
                    column = np.empty(len(values), dtype=object)
                    column[:] = values
            except (ValueError, TypeError):
                pass
        columns[key] = column
    rm_scores = rewards.rm_scores if device is None else rewards.rm_scores.to(device)
    keys = list(extras)
    return {
        "rm_scores": rm_scores,
        "reward_extra_keys": keys,
        "reward_extra_info": columns,
        "meta_info": {"reward_extra_keys": keys, FINAL_SCORES_KEY: True},
    }


# ---------------------------------------------------------------- configuration
def scorer_spec(compute_score: Any) -> tuple[str, dict[str, Any]]:
    """``(spec, reward_kwargs)`` the worker processes load ``compute_score`` from.

    Functions travel by name: the workers import them, so they must be top-level
    functions of a module or file. ``functools.partial`` keywords (and verl's
    ``get_custom_reward_fn`` wrapper) become reward_kwargs.
    """
    if compute_score is None:
        return "rules", {}
    if isinstance(compute_score, str):
        if not compute_score:
            raise ConfigError("compute_score", "empty spec")
        return compute_score, {}
    if isinstance(compute_score, functools.partial):
        func, args, keywords = compute_score.func, compute_score.args, compute_score.keywords
        if (
            getattr(func, "__name__", "") in ("_call_with_kwargs", "_call_with_kwargs_async")
            and len(args) == 2
            and not keywords
        ):
            spec, kwargs = scorer_spec(args[0])  # verl: partial(_call_with_kwargs, raw_fn, reward_kwargs)
            return spec, {**kwargs, **dict(args[1])}
        if args:
            raise ConfigError(
                "compute_score",
                "a functools.partial with positional arguments cannot be sent to worker processes; bind keywords only",
            )
        spec, kwargs = scorer_spec(func)
        return spec, {**kwargs, **keywords}
    if not callable(compute_score):
        raise ConfigError("compute_score", f"expected a function or a spec string, got {type(compute_score).__name__}")
    module_name = getattr(compute_score, "__module__", None) or ""
    qualname = getattr(compute_score, "__qualname__", "") or ""
    module = sys.modules.get(module_name)
    if (
        module_name == "__main__"
        or module is None
        or not qualname.isidentifier()
        or getattr(module, qualname, None) is not compute_score
    ):
        raise ConfigError(
            "compute_score",
            f"{compute_score!r} cannot be loaded by the worker processes: pass a top-level "
            f"function of an importable module or file (not a lambda, a nested function or "
            f"one defined in __main__), or a 'module.path:func' / 'file.py:func' spec",
        )
    path = getattr(module, "__file__", None)
    if "." in module_name or hasattr(module, "__path__") or not path:
        return f"{module_name}:{qualname}", {}
    # A top-level module (a script's sibling, a file loaded by path): by file, since
    # the workers' sys.path need not hold its directory.
    return f"{path}:{qualname}", {}


def _manager_options(manager_kwargs: Mapping[str, Any], fn_kwargs: dict[str, Any]) -> dict[str, Any]:
    fields = ManagerConfig.__dataclass_fields__
    options: dict[str, Any] = {}
    reward_kwargs: dict[str, Any] = dict(fn_kwargs)
    for key, value in manager_kwargs.items():
        if key in _IGNORED:
            continue
        key = _ALIASES.get(key, key)
        if key in _RESERVED:
            raise ConfigError(key, f"set it with the {_RESERVED[key]!r} argument")
        value = _plain(value)
        if key == "reward_kwargs":
            reward_kwargs.update(value or {})
        elif key in fields:
            if value is None and fields[key].default is not None:
                continue  # verl's "unset" for a key that has a default here
            options[key] = value
        else:
            reward_kwargs[key] = value
    if reward_kwargs:
        options["reward_kwargs"] = reward_kwargs
    for key, value in {**options, **reward_kwargs}.items():
        try:
            json.dumps(value)
        except (TypeError, ValueError) as exc:
            raise ConfigError(key, f"must be JSON-serializable to reach the worker processes: {exc}") from None
    return options


async def _check_buildable(config: ManagerConfig) -> None:
    scorer = build_scorer(config)
    close = getattr(scorer, "aclose", None)
    if close is not None:
        await close()
