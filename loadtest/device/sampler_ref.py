"""The one-row sampler the batched one replaced: per sampled row, temperature, top-k, a
full-vocabulary sort for top-p, softmax and the row's own seeded draw. It draws the same
tokens as ``tokenrouter_ray.engine.sampler.sample`` (tests/engine/test_sampling_batched.py),
and the device check times both at batch 64 (``gpu_flagship.bench_flagship``)."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.sampler import position_seed, race_noise


def filter_one_row(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """The former per-row filter: temperature, top-k, then top-p by a full sort."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample_per_row(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> torch.Tensor:
    """The former sampler: one filter and one draw per non-greedy row."""
    tokens = logits.argmax(-1)
    for row, p in enumerate(params):
        if p.is_greedy:
            continue
        probs = filter_one_row(logits[row].float(), p).softmax(-1)  # (vocab,)
        key = torch.tensor([position_seed(seeds[row], positions[row])], device=logits.device)
        noise = race_noise(key, probs.shape[0])[0]  # (vocab,): this row's stream alone
        tokens[row] = (probs / noise).argmax()
    return tokens


SETTINGS = {
    "top_k=50 top_p=0.95 T=0.7": SamplingParams(temperature=0.7, top_k=50, top_p=0.95),
    "top_p=0.95 T=0.7": SamplingParams(temperature=0.7, top_p=0.95),
    "T=1.0": SamplingParams(temperature=1.0),
}
