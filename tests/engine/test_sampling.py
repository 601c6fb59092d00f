"""Seeded sampling does not depend on batch neighbours; filters keep what they promise."""

from __future__ import annotations

import math

import torch

from tests.engine.conftest import make_engine
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.sampler import filter_logits, sample

HOT = SamplingParams(temperature=1.3, top_p=0.95, top_k=50, max_tokens=16, seed=1234)


def test_same_seed_same_tokens_alone_and_in_a_batch_of_8(tiny_model_dir) -> None:
    prompt = [5, 17, 3, 99, 42]
    alone = make_engine(tiny_model_dir).generate([prompt], HOT)[0]
    engine = make_engine(tiny_model_dir)
    neighbours = [[i + 1] * (i + 2) for i in range(7)]
    for i, p in enumerate(neighbours):
        engine.add_request(f"n{i}", p, SamplingParams(temperature=1.0, max_tokens=16, seed=i))
    batched = engine.generate([prompt], HOT)[0]
    assert batched == alone
    other_seed = make_engine(tiny_model_dir).generate(
        [prompt], SamplingParams(temperature=1.3, top_p=0.95, top_k=50, max_tokens=16, seed=99)
    )[0]
    assert other_seed != alone  # the seed matters (16 draws at temperature 1.3)


def test_top_k_one_is_greedy() -> None:
    logits = torch.randn(4, 100, generator=torch.Generator().manual_seed(0))
    params = [SamplingParams(temperature=2.0, top_k=1)] * 4
    assert sample(logits, params, [1, 2, 3, 4], [0, 0, 0, 0]).tolist() == logits.argmax(-1).tolist()


def test_top_p_keeps_the_smallest_set_reaching_p() -> None:
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    kept = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.isfinite(kept).tolist() == [True, True, False, False]
    kept = filter_logits(probs.log(), SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.isfinite(kept).tolist() == [True, True, True, False]


def test_draws_follow_the_distribution() -> None:
    """Across positions, frequencies match softmax(logits / T) within 4 standard deviations."""
    probs = torch.tensor([0.5, 0.3, 0.15, 0.05])
    n = 4000
    logits = probs.log().repeat(n, 1)
    params = [SamplingParams(temperature=1.0)] * n
    tokens = sample(logits, params, [7] * n, list(range(n)))
    counts = torch.bincount(tokens, minlength=4).double() / n
    for p, f in zip(probs.tolist(), counts.tolist(), strict=True):
        assert abs(f - p) < 4 * math.sqrt(p * (1 - p) / n)
