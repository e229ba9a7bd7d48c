"""A tiny causal LM and tokenizer made offline (no hub), for TRL's GRPOTrainer on CPU."""

from __future__ import annotations

from pathlib import Path
from typing import Any

# A chat template for conversational prompts: role-tagged turns, then the assistant's tag.
CHAT_TEMPLATE = (
    "{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<assistant>{% endif %}"
)


def tiny_model(path: Path) -> str:
    """Save a byte-level BPE tokenizer and a 2-layer Llama with random weights at ``path``."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

    corpus = ["The answer is #### 42", "What is 6 times 7?", "Answer: 7", "so x = 3"] * 50
    tok = Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=320,
        special_tokens=["<pad>", "<unk>", "<eos>"],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
    )
    tok.train_from_iterator(corpus, trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
    fast.chat_template = CHAT_TEMPLATE
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
        bos_token_id=None,
    )
    LlamaForCausalLM(config).save_pretrained(str(path))
    return str(path)


def grpo_args(output_dir: Path, **overrides: Any) -> Any:
    """GRPOConfig for one step on CPU: 4 prompts x 4 generations of 8 tokens."""
    from trl import GRPOConfig

    values: dict[str, Any] = dict(
        output_dir=str(output_dir),
        per_device_train_batch_size=16,
        num_generations=4,
        max_completion_length=8,
        max_steps=1,
        learning_rate=1e-4,
        logging_steps=1,
        save_strategy="no",
        report_to=[],
        use_cpu=True,
        bf16=False,
        seed=0,
        dataloader_num_workers=0,
        disable_tqdm=True,
    )
    values.update(overrides)
    return GRPOConfig(**values)
