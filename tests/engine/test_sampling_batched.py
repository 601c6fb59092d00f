"""The batched sampler draws exactly what the former one-row recipe drew (same seeds, same
tokens), for mixed batches of greedy, temperature, top-k and top-p rows, also on bf16-valued
logits (many exact ties at the top-k and top-p boundaries)."""

from __future__ import annotations

import random

import pytest
import torch

from loadtest.device.sampler_ref import filter_one_row, sample_per_row
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.sampler import filter_rows, sample


def batch(trial: int, rows: int, vocab: int) -> tuple[torch.Tensor, list[SamplingParams]]:
    rng = random.Random(trial)
    logits = torch.randn(rows, vocab, generator=torch.Generator().manual_seed(trial))
    logits = logits * rng.choice([1.0, 3.0, 10.0])
    if trial % 2:
        logits = logits.bfloat16().float()  # ties, as bf16 model logits have
    params = [
        SamplingParams(
            temperature=rng.choice([0.0, 0.7, 1.0, 1.3]),
            top_k=rng.choice([0, 0, 1, 50, 200]),
            top_p=rng.choice([1.0, 0.9, 0.95, 0.5]),
            max_tokens=4,
        )
        for _ in range(rows)
    ]
    return logits, params


@pytest.mark.parametrize("trial", range(40))
def test_batched_sampling_draws_the_per_row_tokens(trial: int) -> None:
    rows, vocab = random.Random(trial).choice([(1, 300), (8, 1000), (64, 5000)])
    logits, params = batch(trial, rows, vocab)
    seeds = [trial * 100 + i for i in range(rows)]
    positions = [i * 7 for i in range(rows)]
    want = sample_per_row(logits.clone(), params, seeds, positions)
    got = sample(logits.clone(), params, seeds, positions)
    assert got.tolist() == want.tolist()


@pytest.mark.parametrize("trial", range(20))
def test_batched_filters_keep_the_per_row_sets(trial: int) -> None:
    logits, params = batch(trial, 16, 2000)
    hot = [i for i, p in enumerate(params) if not p.is_greedy]
    got = filter_rows(logits[hot], [params[i] for i in hot])
    for j, i in enumerate(hot):
        want = filter_one_row(logits[i], params[i])
        assert torch.isfinite(got[j]).tolist() == torch.isfinite(want).tolist()
        kept = torch.isfinite(want)
        assert torch.equal(got[j][kept], want[kept])
