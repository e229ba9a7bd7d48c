"""TRL's GRPOTrainer with its rewards from stream-reward, on CPU, with no download.

    pip install 'stream-reward[trainer]' torch==2.13.0 trl==1.16.0
    python examples/trl_grpo.py

The one line that matters is ``reward_funcs=[reward_func(...)]``: without a Redis URL
it starts an embedded server and two local workers scoring with the ``rules`` scorer
(GSM8K's ``#### <number>``), once per process, and stops them at exit. Everything
else builds a tiny random model and tokenizer offline so that the example runs
anywhere in a minute; with a real model, pass its name to ``GRPOTrainer(model=...)``.
"""

from __future__ import annotations

import tempfile
from pathlib import Path

import torch
from datasets import Dataset
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast
from trl import GRPOConfig, GRPOTrainer

from stream_reward.trl import reward_func


def tiny_model(path: Path) -> str:
    """A byte-level BPE tokenizer and a 2-layer Llama with random weights, saved at ``path``."""
    corpus = ["The answer is #### 42", "What is 6 times 7?", "Natalia sold 48 clips", "#### 72"] * 50
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator(
        corpus,
        trainers.BpeTrainer(
            vocab_size=320,
            special_tokens=["<pad>", "<unk>", "<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        ),
    )
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    # Conversational prompts need a chat template: role-tagged turns, then the assistant's tag.
    fast.chat_template = (
        "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}"
    )
    fast.save_pretrained(str(path))
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=len(fast),
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=2,
        max_position_embeddings=128,
        pad_token_id=fast.pad_token_id,
        eos_token_id=fast.eos_token_id,
    )
    LlamaForCausalLM(config).save_pretrained(str(path))
    return str(path)


def main() -> None:
    work = Path(tempfile.mkdtemp(prefix="trl-grpo-"))
    # A conversational GSM8K-like dataset: the answer column is "solution" (the default
    # ground_truth_key); every other column would reach the scorer as extra_info.
    dataset = Dataset.from_list(
        [
            {"prompt": [{"role": "user", "content": "What is 6 times 7?"}], "solution": "42"},
            {"prompt": [{"role": "user", "content": "Natalia sold 48 clips, then 24. Total?"}], "solution": "72"},
        ]
    )
    trainer = GRPOTrainer(
        model=tiny_model(work / "model"),
        reward_funcs=[reward_func(scorer="rules", data_source="openai/gsm8k", name="gsm8k")],
        args=GRPOConfig(
            output_dir=str(work / "out"),
            per_device_train_batch_size=8,
            num_generations=4,
            max_completion_length=16,
            max_steps=2,
            logging_steps=1,
            save_strategy="no",
            report_to=[],
            use_cpu=True,
            bf16=False,
            disable_tqdm=True,
        ),
        train_dataset=dataset,
    )
    trainer.train()
    for log in trainer.state.log_history:
        if "rewards/gsm8k/mean" in log:
            print(f"step {log['step']}: rewards/gsm8k/mean = {log['rewards/gsm8k/mean']:.3f}")


if __name__ == "__main__":
    main()
