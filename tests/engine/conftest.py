"""Tiny random-weight models saved to disk and loaded through the engine's own code path.

They run in float64: tiny random models have near-tied logits, and float64 keeps batched
and unbatched math from flipping an argmax, so exactness tests hold by construction.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest
import torch
from transformers import AutoModelForCausalLM

from tests.tiny_models import TINY, save_tiny
from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.scheduler import SchedulerConfig

# The shared tiny shape (tests/tiny_models.py), re-exported for the tests that import it here.
__all__ = ["TINY", "assert_blocks_accounted", "greedy_reference", "make_engine", "save_tiny"]


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def tiny_model_dir(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny(tmp_path_factory.mktemp(request.param), request.param)


@pytest.fixture(scope="session")
def tiny_llama_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return save_tiny(tmp_path_factory.mktemp("llama"), "llama")


@pytest.fixture(scope="session")
def reference_model() -> Callable[[str], torch.nn.Module]:
    """The plain transformers model (its own SDPA attention), loaded once per directory."""
    cache: dict[str, torch.nn.Module] = {}

    def load(path: str) -> torch.nn.Module:
        if path not in cache:
            model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float64)
            cache[path] = model.eval()
        return cache[path]

    return load


def make_engine(path: str, num_blocks: int = 256, block_size: int = 4, **kwargs: object) -> Engine:
    sched = {k: kwargs.pop(k) for k in list(kwargs) if k in SchedulerConfig.model_fields}
    return Engine.from_config(
        EngineConfig(
            model=path,
            dtype="float64",
            num_blocks=num_blocks,
            block_size=block_size,
            scheduler=SchedulerConfig(**sched),
            **kwargs,
        )
    )


def assert_blocks_accounted(engine: Engine) -> None:
    """Every block's reference count is the number of live requests holding it, and the
    pool's used blocks are exactly the held ones: no block leaked, none freed while held.
    A block may have several holders (a prefix-cache hit shares it)."""
    holders = Counter(b for r in engine.requests.values() for b in r.block_ids)
    pool = engine.kv.pool
    assert {b: n for b, n in enumerate(pool.ref_counts) if n} == dict(holders)
    assert pool.num_used_blocks == len(holders)


def greedy_reference(model: torch.nn.Module, prompt: list[int], n: int) -> list[int]:
    out = model.generate(
        torch.tensor([prompt]), do_sample=False, max_new_tokens=n, min_new_tokens=n
    )
    return out[0, len(prompt) :].tolist()


@pytest.fixture(scope="session")
def demo_model_dir() -> str:
    """The real SmolLM2-135M-Instruct, built once and cached (scripts/test.sh prepares it)."""
    from tokenrouter_ray.demo.large import prepare_demo

    return str(prepare_demo(quiet=True))
