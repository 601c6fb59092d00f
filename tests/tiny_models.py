"""The one tiny random-weight model shape every test builds from.

``TINY`` is the shape (128-token vocabulary, 64 wide, 2 layers, 4 query / 2 KV heads, no
special tokens); ``tiny_config(arch, **changes)`` makes a transformers config of it for
``llama`` or ``qwen3`` (Qwen3 with ``head_dim`` 16), and ``save_tiny`` writes a seeded model
to a directory, which the engine then loads through its own code path (the weights drawn by
the package's one factory, ``tokenrouter_ray/engine/random_model.py``). Tests that need a
variant (more layers, tied embeddings, a real tokenizer's vocabulary) pass the changes
instead of writing the shape again. Fixtures over it live in ``tests/engine/conftest.py``.

The chain (``small``/``mid``/``large``: 1, 2, 3 layers, wide initial weights so that
distributions are peaked and entropies and router decisions spread over a useful range) is
what the routing, runtime and deployment tests share; ``tests/conftest.py`` turns it into
session fixtures, with a word-level tokenizer for the HTTP tests.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, PretrainedConfig, PreTrainedModel, Qwen3Config

from tokenrouter_ray.engine.random_model import random_causal_lm

TINY: dict[str, Any] = dict(
    vocab_size=128,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=512,
    bos_token_id=None,
    eos_token_id=None,
    pad_token_id=None,
)
ARCHS = {"llama": (LlamaConfig, {}), "qwen3": (Qwen3Config, {"head_dim": 16})}


def tiny_config(arch: str = "llama", **changes: Any) -> PretrainedConfig:
    """The tiny shape as a ``llama`` or ``qwen3`` config, with ``changes`` applied."""
    config_cls, extra = ARCHS[arch]
    return config_cls(**{**TINY, **extra, **changes})


def tiny_model(arch: str = "llama", seed: int = 0, **changes: Any) -> PreTrainedModel:
    """A seeded random-weight model of the tiny shape (float32, train mode off)."""
    _, extra = ARCHS[arch]
    return random_causal_lm(arch, seed, **{**TINY, **extra, **changes})


def save_tiny(
    path: Path,
    arch: str = "llama",
    seed: int = 0,
    dtype: torch.dtype = torch.float64,
    **changes: Any,
) -> str:
    """Save a seeded tiny model (``dtype``: float64 by default, so batched and unbatched
    math cannot flip an argmax) to ``path``; returns the path as a string."""
    tiny_model(arch, seed, **changes).to(dtype).save_pretrained(path)
    return str(path)


CHAIN_NAMES = ["small", "mid", "large"]
CHAIN_SHAPES = {"small": (1, 11), "mid": (2, 12), "large": (3, 13)}  # layers, seed
TINY_CHAT_TEMPLATE = "{% for m in messages %}{{ m['content'] }} {% endfor %}"


def save_chain_model(path: Path, layers: int, seed: int) -> str:
    return save_tiny(path, "llama", seed, num_hidden_layers=layers, initializer_range=0.4)


def save_chain(root: Path, with_tokenizer: bool = False) -> dict[str, str]:
    """The three chain models under ``root``, optionally each with the tiny tokenizer."""
    dirs = {}
    for name in CHAIN_NAMES:
        layers, seed = CHAIN_SHAPES[name]
        dirs[name] = save_chain_model(root / name, layers, seed)
        if with_tokenizer:
            save_tiny_tokenizer(root / name)
    return dirs


def chain_engines(chain_dirs: dict[str, str], names: list[str], **kwargs: object) -> list:
    from tests.engine.conftest import make_engine

    return [(name, make_engine(chain_dirs[name], **kwargs)) for name in names]


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
