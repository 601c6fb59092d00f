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

from tokenrouter_ray.engine.outputs import TokenLogprobs
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


def token_logprobs(
    logits: torch.Tensor,  # (num_rows, vocab)
    tokens: torch.Tensor,  # (num_rows,) the sampled ids
    top: Sequence[int | None],  # per row: None (not asked) or how many alternatives
) -> list[TokenLogprobs | None]:
    """log_softmax of the raw logits (before temperature, top-k and top-p: vLLM's default
    "raw" logprobs) at each asked row: the sampled token's and the ``top[row]`` largest,
    descending. Only the asked rows are normalised and copied to the host."""
    rows = [i for i, k in enumerate(top) if k is not None]
    out: list[TokenLogprobs | None] = [None] * len(top)
    if not rows:
        return out
    index = torch.tensor(rows, dtype=torch.long, device=logits.device)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)
    chosen = logp.gather(1, tokens.index_select(0, index)[:, None])[:, 0].tolist()
    k_max = max(top[i] for i in rows)
    ids: list[list[int]] = [[] for _ in rows]
    values: list[list[float]] = [[] for _ in rows]
    if k_max:
        best = torch.topk(logp, k_max, dim=-1)
        ids, values = best.indices.tolist(), best.values.tolist()
    for j, i in enumerate(rows):
        k = top[i]
        out[i] = (chosen[j], ids[j][:k], values[j][:k])
    return out
