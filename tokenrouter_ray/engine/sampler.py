"""Next-token sampling: greedy, temperature, top-k, top-p, with per-request seeds.

A request's random draw at a position depends only on (its seed, that position), never on
the batch it shares: each sampled row gets its own generator seeded from both, and draws
by the exponential race (``argmax(p / E)``, ``E ~ Exp(1)``), which samples exactly from
``p`` with one vector of noise. Logits enter as (num_rows, vocab) float tensors; token ids
leave as a (num_rows,) long tensor on the same device.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from tokenrouter_ray.engine.request import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over 63 bits


def position_seed(seed: int, position: int) -> int:
    return (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p, on one row of (vocab,) float logits."""
    logits = logits / params.temperature
    if params.top_k and params.top_k < logits.shape[-1]:
        kth = torch.topk(logits, params.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if params.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        drop = cum - sorted_logits.softmax(-1) >= params.top_p  # keep the token crossing p
        logits = logits.masked_fill(drop.scatter(0, order, drop), float("-inf"))
    return logits


def sample(
    logits: torch.Tensor,  # (num_rows, vocab)
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> torch.Tensor:
    tokens = logits.argmax(-1)  # (num_rows,) greedy for every row, overwritten below
    for row, p in enumerate(params):
        if p.is_greedy:
            continue
        probs = filter_logits(logits[row].float(), p).softmax(-1)
        gen = torch.Generator(device=logits.device)
        gen.manual_seed(position_seed(seeds[row], positions[row]))
        noise = torch.empty_like(probs).exponential_(generator=gen)
        tokens[row] = (probs / noise).argmax()
    return tokens
