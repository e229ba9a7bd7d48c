"""``stream-reward bench vs_verl``: the same GSM8K batch scored by verl 0.9.1's
reward loop (``naive`` manager) and by stream-reward end to end, in one run.

verl side: a ``RewardLoopWorker`` built from a config the way verl's
``RewardLoopManager`` builds each of its workers, driven the way the manager
drives it, in-process (no Ray): ``compute_score_batch(data)`` (a task per sample,
each ``run_single`` detokenizing and calling ``default_compute_score`` through the
loop's default executor), then ``assemble_rm_scores``.

stream-reward side: the same token ids are detokenized on the rollout side
(``batch_decode`` per pushed chunk, inside the timed region), pushed with
RolloutProducer, scored by worker processes with the rule scorers, and collected
into rm_scores by RewardAggregator. That is the headline rate and the one the
goal is judged on. A second run pushes text the rollout already has (inference
servers return it with the ids), so the detokenization is not charged: it is
reported as ``stream_reward_text_samples_per_s``. Worker start-up is outside the
timed region on both sides (verl's worker and tokenizer are built before the
clock starts).

No tokenizer can be downloaded here, so both sides use the same byte-level BPE
tokenizer trained on the batch's text at start (a real HF fast tokenizer: its
decode costs what a small production tokenizer's does).

Needs ``verl==0.9.1`` importable; otherwise the bench reports ``skipped``.
"""

from __future__ import annotations

import argparse
import asyncio
import random
import statistics
import sys
import tempfile
import time
from typing import Any

from stream_reward.bench._common import (
    Progress,
    Workers,
    add_torch_threads,
    bench_main,
    bench_parser,
    gsm8k_pool,
    plot_figure,
    quiet_server,
    save_figure,
    say,
    setup_torch,
)

VERL_VERSION = "0.9.1"
NAMESPACE = "vsverl"
PROMPT_LEN = 64


def parse(argv: list[str]) -> argparse.Namespace:
    parser = bench_parser("vs_verl", __doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16384, help="samples in the batch")
    parser.add_argument("--bytes", type=int, default=1024, help="approximate response size")
    parser.add_argument("--processes", type=int, default=2, help="stream-reward worker processes")
    parser.add_argument(
        "--repeats", type=int, default=3, help="alternating verl / stream-reward runs; medians reported"
    )
    add_torch_threads(parser)
    return parser.parse_args(argv)


def verl_status() -> str | None:
    """None when verl 0.9.1 is importable, else why the bench cannot run."""
    try:
        import verl  # type: ignore[import-not-found]
        from verl.experimental.reward_loop.reward_loop import RewardLoopWorker  # type: ignore[import-not-found]  # noqa: F401
    except Exception as exc:  # ImportError, or a broken install raising anything at import
        return f"verl=={VERL_VERSION} is not importable ({type(exc).__name__}: {exc}); install it in a separate venv to run this bench"
    version = getattr(verl, "__version__", "unknown")
    if version != VERL_VERSION:
        return f"found verl {version}, this bench drives verl=={VERL_VERSION}'s reward loop"
    return None


# ---------------------------------------------------------------------- data
def build_tokenizer(texts: list[str], directory: str) -> Any:
    """A byte-level BPE trained on ``texts``, saved where AutoTokenizer can load it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers  # type: ignore[import-not-found]
    from transformers import PreTrainedTokenizerFast  # type: ignore[import-not-found]

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2000,
        special_tokens=["<pad>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(texts, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")
    fast.save_pretrained(directory)
    return fast


def build_batch(tokenizer: Any, pool: list[dict[str, Any]], n: int) -> tuple[Any, list[str], list[int], int]:
    """verl's DataProto for ``n`` samples: left-padded prompts, right-padded responses."""
    import numpy as np
    import torch
    from verl import DataProto

    pad = tokenizer.pad_token_id
    prompts = [tokenizer.encode(s["prompt"])[-PROMPT_LEN:] for s in pool]
    responses = [tokenizer.encode(s["response"]) for s in pool]
    resp_len = max(len(r) for r in responses)
    prompt_t = torch.full((n, PROMPT_LEN), pad, dtype=torch.long)
    resp_t = torch.full((n, resp_len), pad, dtype=torch.long)
    mask = torch.zeros((n, PROMPT_LEN + resp_len), dtype=torch.long)
    lengths = []
    for i in range(n):
        p, r = prompts[i % len(pool)], responses[i % len(pool)]
        prompt_t[i, PROMPT_LEN - len(p) :] = torch.tensor(p)
        resp_t[i, : len(r)] = torch.tensor(r)
        mask[i, PROMPT_LEN - len(p) : PROMPT_LEN + len(r)] = 1
        lengths.append(len(r))
    data = DataProto.from_dict(
        tensors={
            "prompts": prompt_t,
            "responses": resp_t,
            "attention_mask": mask,
            "input_ids": torch.cat([prompt_t, resp_t], dim=1),
        },
        non_tensors={
            "data_source": np.array(["openai/gsm8k"] * n, dtype=object),
            "reward_model": np.array(
                [{"ground_truth": pool[i % len(pool)]["ground_truth"], "style": "rule"} for i in range(n)], dtype=object
            ),
            "extra_info": np.array([{"index": i} for i in range(n)], dtype=object),
        },
    )
    ground_truths = [pool[i % len(pool)]["ground_truth"] for i in range(n)]
    return data, ground_truths, lengths, resp_len


# ---------------------------------------------------------------------- verl
def verl_config(tokenizer_dir: str) -> Any:
    from omegaconf import OmegaConf  # type: ignore[import-not-found]

    return OmegaConf.create(
        {
            "actor_rollout_ref": {"model": {"path": tokenizer_dir, "tokenizer_path": tokenizer_dir}},
            "reward": {
                "num_workers": 1,
                "reward_manager": {"name": "naive", "source": "register", "module": {"path": None, "name": None}},
                "custom_reward_function": {"path": None, "name": None},
                "reward_model": {"enable": False, "enable_resource_pool": False, "model_path": None},
                "sandbox_fusion": None,
            },
        }
    )


async def run_verl(worker: Any, data: Any) -> tuple[float, list[float], Any]:
    """What RewardLoopManager.compute_rm_score does with one worker, without Ray."""
    start = time.perf_counter()
    outputs = await worker.compute_score_batch(data)
    scores = [item["reward_score"] for item in outputs]
    rm_scores = type(worker.reward_manager).assemble_rm_scores(data, scores)
    elapsed = time.perf_counter() - start
    return elapsed, scores, rm_scores


# ---------------------------------------------------------------------- stream-reward
async def run_stream(
    url: str,
    batch_id: str,
    tokenizer: Any,
    data: Any,
    ground_truths: list[str],
    lengths: list[int],
    resp_len: int,
    *,
    texts: list[str] | None = None,
    chunk: int = 256,
) -> tuple[float, list[float], Any]:
    """Push, score, collect; detokenizing each chunk first unless ``texts`` are given."""
    from stream_reward.config import ProducerConfig
    from stream_reward.trainer.aggregator import RewardAggregator
    from stream_reward.trainer.producer import RolloutProducer
    from stream_reward.wire.trajectory import Trajectory

    responses = data.batch["responses"]
    n = len(lengths)
    start = time.perf_counter()
    async with (
        RolloutProducer(url, ProducerConfig(namespace=NAMESPACE)) as producer,
        RewardAggregator(url, namespace=NAMESPACE) as agg,
    ):
        await producer.open_batch(batch_id, n, resp_len)

        async def produce() -> None:
            for lo in range(0, n, chunk):
                hi = min(n, lo + chunk)
                if texts is None:
                    chunk_texts = tokenizer.batch_decode(
                        [responses[i, : lengths[i]].tolist() for i in range(lo, hi)], skip_special_tokens=True
                    )
                else:
                    chunk_texts = texts[lo:hi]
                await producer.push_many(
                    [
                        Trajectory(
                            batch_id=batch_id,
                            index=i,
                            data_source="openai/gsm8k",
                            response=chunk_texts[i - lo],
                            ground_truth=ground_truths[i],
                            valid_response_length=lengths[i],
                        )
                        for i in range(lo, hi)
                    ]
                )

        pusher = asyncio.create_task(produce())
        rewards = await agg.collect(batch_id, timeout_s=600)
        await pusher
    elapsed = time.perf_counter() - start
    return elapsed, rewards.scores, rewards.rm_scores


# ---------------------------------------------------------------------- main
async def run(args: argparse.Namespace) -> dict[str, Any]:
    import torch
    from verl.experimental.reward_loop.reward_loop import RewardLoopWorker

    setup_torch(args)
    rng = random.Random(args.seed)
    pool = gsm8k_pool(rng, 1024, args.bytes)
    verl_rates, sr_rates, text_rates = [], [], []
    with tempfile.TemporaryDirectory(prefix="vs-verl-tok-") as tokdir:
        tokenizer = build_tokenizer([s["prompt"] + " " + s["response"] for s in pool], tokdir)
        data, ground_truths, lengths, resp_len = build_batch(tokenizer, pool, args.n)
        worker = RewardLoopWorker(verl_config(tokdir), None)
        responses = data.batch["responses"]
        texts = tokenizer.batch_decode(
            [responses[i, : lengths[i]].tolist() for i in range(args.n)], skip_special_tokens=True
        )
        with quiet_server() as server, Workers(server.url, NAMESPACE, args.processes, "--scorer", "rules") as workers:
            await workers.ready()
            with Progress(args, "vs_verl", total=3 * args.repeats) as bar:
                for rep in range(args.repeats):
                    v_elapsed, v_scores, v_rm = await run_verl(worker, data)
                    verl_rates.append(args.n / v_elapsed)
                    bar.advance()
                    say(args, f"verl reward loop run {rep + 1}: {verl_rates[-1]:,.0f} samples/s")
                    s_elapsed, s_scores, s_rm = await run_stream(
                        server.url, f"vs{rep}", tokenizer, data, ground_truths, lengths, resp_len
                    )
                    sr_rates.append(args.n / s_elapsed)
                    bar.advance()
                    say(args, f"stream-reward run {rep + 1}: {sr_rates[-1]:,.0f} samples/s")
                    t_elapsed, t_scores, _ = await run_stream(
                        server.url, f"vs{rep}-text", tokenizer, data, ground_truths, lengths, resp_len, texts=texts
                    )
                    text_rates.append(args.n / t_elapsed)
                    bar.advance()
                    say(args, f"stream-reward run {rep + 1}, text pushed: {text_rates[-1]:,.0f} samples/s")
    agree = sum(1 for a, b, c in zip(v_scores, s_scores, t_scores) if float(a) == float(b) == float(c))
    verl_rate = statistics.median(verl_rates)
    sr_rate = statistics.median(sr_rates)
    text_rate = statistics.median(text_rates)
    import verl

    return {
        "n": args.n,
        "verl_samples_per_s": round(verl_rate, 1),
        "stream_reward_samples_per_s": round(sr_rate, 1),
        "ratio": round(sr_rate / verl_rate, 2),
        "stream_reward_text_samples_per_s": round(text_rate, 1),
        "ratio_text": round(text_rate / verl_rate, 2),
        "verl_version": verl.__version__,
        "verl_manager": "naive (reward loop, RewardLoopWorker in-process)",
        "processes": args.processes,
        "scores_agree": agree,
        "rm_scores_equal": bool(torch.equal(v_rm.float(), s_rm)),
        "runs_verl_samples_per_s": [round(r) for r in verl_rates],
        "runs_stream_reward_samples_per_s": [round(r) for r in sr_rates],
        "runs_stream_reward_text_samples_per_s": [round(r) for r in text_rates],
    }


def plot(path: str, result: dict[str, Any]) -> None:
    plt = plot_figure(path)
    fig, ax = plt.subplots(figsize=(6, 4))
    ax.bar(
        ["verl reward loop\n(naive)", f"stream-reward\n({result['processes']} workers)", "stream-reward,\ntext pushed"],
        [
            result["verl_samples_per_s"],
            result["stream_reward_samples_per_s"],
            result["stream_reward_text_samples_per_s"],
        ],
        color=["#999999", "#1f77b4", "#aec7e8"],
    )
    ax.set_ylabel("samples / s")
    ax.set_title(
        f"GSM8K, {result['n']:,} samples: {result['ratio']}x verl ({result['ratio_text']}x with text pushed)",
        fontsize=10,
    )
    save_figure(fig, path)


def goals(result: dict[str, Any]) -> dict[str, bool]:
    return {
        "stream-reward >= 5x verl reward loop": result["ratio"] >= 5.0,
        "same scores as verl": result["scores_agree"] == result["n"],
    }


def main(argv: list[str] | None = None) -> int:
    return bench_main("vs_verl", argv, parse, run, plot, goals, skip=verl_status)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
