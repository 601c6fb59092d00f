"""Tiny random-weight model pairs (and a 3-model chain) with peaked distributions, in
float64, so entropy and router decisions spread over a useful range and batched vs.
unbatched math cannot flip a decision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.engine.conftest import make_engine
from tests.tiny_models import save_tiny

MODEL_NAMES = ["small", "mid", "large"]


def save_chain_model(path: Path, layers: int, seed: int) -> str:
    return save_tiny(path, "llama", seed, num_hidden_layers=layers, initializer_range=0.4)


@pytest.fixture(scope="session")
def chain_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("chain")
    return {
        name: save_chain_model(root / name, layers, seed)
        for name, layers, seed in zip(MODEL_NAMES, (1, 2, 3), (11, 12, 13), strict=True)
    }


@pytest.fixture(scope="session")
def chain_reference_models(chain_dirs: dict[str, str]) -> dict[str, torch.nn.Module]:
    return {
        name: AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64).eval()
        for name, path in chain_dirs.items()
    }


def chain_engines(chain_dirs: dict[str, str], names: list[str], **kwargs: object) -> list:
    return [(name, make_engine(chain_dirs[name], **kwargs)) for name in names]


TINY_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def save_tiny_tokenizer(path: Path) -> None:
    """A word-level tokenizer over the tiny models' 128 ids: token i is the word ``w{i}``,
    so text maps back to ids exactly (the unknown token is an extra id the models never
    produce)."""
    from tokenizers import Tokenizer
    from tokenizers.models import WordLevel
    from tokenizers.pre_tokenizers import WhitespaceSplit
    from transformers import PreTrainedTokenizerFast

    vocab = {f"w{i}": i for i in range(128)} | {"<unk>": 128}
    tok = Tokenizer(WordLevel(vocab, unk_token="<unk>"))
    tok.pre_tokenizer = WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, unk_token="<unk>")
    fast.chat_template = TINY_CHAT_TEMPLATE
    fast.save_pretrained(path)


@pytest.fixture(scope="session")
def served_chain_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, str]:
    """The chain models again, each directory with the tiny tokenizer, for HTTP tests."""
    root = tmp_path_factory.mktemp("served")
    dirs = {}
    for name, layers, seed in zip(MODEL_NAMES, (1, 2, 3), (11, 12, 13), strict=True):
        dirs[name] = save_chain_model(root / name, layers, seed)
        save_tiny_tokenizer(root / name)
    return dirs
