"""The verl suite: stream-reward inside verl 0.9.1's own reward loop.

These tests need ``verl==0.9.1`` and torch (CPU is enough): ``.ci/verl.sh`` builds
that environment and sets ``STREAM_REWARD_REQUIRE_VERL=1``, which turns a missing
verl into an error. Without verl (the README's test command) they skip, with the
reason printed in the session header and in one skipped test.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from verl_support import MISSING, SKIP_REASON

# Every module but the placeholder imports verl at its top: not collected without it.
collect_ignore_glob = ["test_verl_*.py"] if MISSING else []


def pytest_report_header(config: pytest.Config) -> str | None:
    return f"tests/verl: skipped, {SKIP_REASON}" if SKIP_REASON else None


def pytest_configure(config: pytest.Config) -> None:
    # verl, Ray and transformers warn at import and on first use; the project's own
    # code stays under filterwarnings=error.
    for line in (
        "ignore::DeprecationWarning",
        "ignore::PendingDeprecationWarning",
        "ignore::FutureWarning",
        "ignore::UserWarning:ray.*",
        "ignore::UserWarning:torch.*",
        "ignore::UserWarning:transformers.*",
        "ignore::UserWarning:hydra.*",
        "ignore::ResourceWarning",
    ):
        config.addinivalue_line("filterwarnings", line)


if not MISSING:

    @pytest.fixture(scope="session")
    def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
        """A real HF fast tokenizer, trained offline on a small corpus (no download)."""
        from tokenizers import Tokenizer, models, pre_tokenizers, trainers
        from transformers import PreTrainedTokenizerFast

        corpus = [
            "The answer is #### 42",
            "so the total is \\boxed{\\frac{1}{2}} and Answer: 7",
            "Let x = 3. Then 2x + 1 = 7. #### 7",
            "Answer: -12 because 3 * -4 = -12",
            "\\boxed{3\\sqrt{2}} \\boxed{10} \\boxed{x^2}",
        ] * 50 + [" ".join(str(n) for n in range(200))]
        tok = Tokenizer(models.BPE(unk_token="<unk>"))
        tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
        from tokenizers import decoders

        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=400,
            special_tokens=["<pad>", "<unk>", "<eos>"],
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        )
        tok.train_from_iterator(corpus, trainer)
        fast = PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", unk_token="<unk>", eos_token="<eos>")
        path = tmp_path_factory.mktemp("tokenizer")
        fast.save_pretrained(str(path))
        return str(path)

    @pytest.fixture(scope="session")
    def tokenizer(tokenizer_dir: str) -> Any:
        from verl.utils import hf_tokenizer

        return hf_tokenizer(tokenizer_dir, trust_remote_code=True)

    @pytest.fixture(scope="session")
    def compose(tokenizer_dir: str):
        """``compose(*overrides)``: verl's own ppo_trainer.yaml through Hydra, resolved as main_ppo does."""
        import verl
        from hydra import compose as hydra_compose
        from hydra import initialize_config_dir
        from hydra.core.global_hydra import GlobalHydra
        from omegaconf import OmegaConf

        config_dir = str(Path(verl.__file__).parent / "trainer" / "config")

        def build(*overrides: str) -> Any:
            GlobalHydra.instance().clear()
            with initialize_config_dir(config_dir=config_dir, version_base=None):
                config = hydra_compose(
                    config_name="ppo_trainer",
                    overrides=[
                        f"actor_rollout_ref.model.path={tokenizer_dir}",
                        "data.max_response_length=16",
                        *overrides,
                    ],
                )
            OmegaConf.resolve(config)
            return config

        return build
