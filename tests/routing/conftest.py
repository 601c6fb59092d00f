"""Tiny random-weight model pairs (and a 3-model chain) with peaked distributions, in
float64, so entropy and router decisions spread over a useful range and batched vs.
unbatched math cannot flip a decision."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig, LlamaForCausalLM

from tests.engine.conftest import TINY, make_engine

MODEL_NAMES = ["small", "mid", "large"]


def save_chain_model(path: Path, layers: int, seed: int) -> str:
    torch.manual_seed(seed)
    cfg = LlamaConfig(**{**TINY, "num_hidden_layers": layers, "initializer_range": 0.4})
    LlamaForCausalLM(cfg).to(torch.float64).save_pretrained(path)
    return str(path)


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
