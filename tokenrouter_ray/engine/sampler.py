"""Next-token sampling: greedy, temperature, min-p, top-k, top-p, with per-request seeds.

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
    """Temperature, then min-p, top-k and top-p, on one row of (vocab,) float logits."""
    return filter_rows(logits[None], [params])[0]


def filter_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p (vLLM's order), on (num_rows, vocab) float
    logits, one ``SamplingParams`` per row, batched: a handful of kernels for the whole
    batch, never a loop of full-vocabulary sorts. The arithmetic per row is the one-row
    recipe's:

    - temperature: each distinct temperature divides its rows by the same Python scalar;
    - min-p (only when some row sets it): a token whose probability after temperature is
      below ``min_p`` times the row's largest is dropped;
    - top-k: one ``topk`` at the largest k; a row's k-th largest value is its threshold
      (ties with it are kept);
    - top-p: the sorted order restricted to the candidates that can survive (after top-k,
      the finite ones: one ``topk`` of that many instead of a sort of the vocabulary; a
      full batched sort only when some row has no top-k); the kept set is the shortest
      sorted prefix whose mass reaches p (the token crossing p is kept).
    """
    rows, vocab = logits.shape
    temps = [p.temperature for p in params]
    if len(set(temps)) == 1:
        out = logits / temps[0]
    else:
        out = torch.empty_like(logits)
        for t in set(temps):
            index = torch.tensor([i for i, v in enumerate(temps) if v == t], device=logits.device)
            out[index] = logits.index_select(0, index) / t
    if any(p.min_p for p in params):
        out = _min_p(out, params)
    ks = [p.top_k if p.top_k and p.top_k < vocab else 0 for p in params]
    ranked = order = None  # the top-k survivors, descending, when top-k saw them all
    if any(ks):
        k_max = max(ks)
        top, top_ids = torch.topk(out, k_max, dim=-1)  # (rows, k_max), descending
        k_index = torch.tensor([max(k, 1) - 1 for k in ks], device=logits.device)
        kth = top.gather(1, k_index[:, None])  # (rows, 1)
        unlimited = torch.tensor([k == 0 for k in ks], device=logits.device)[:, None]
        kth = kth.masked_fill(unlimited, float("-inf"))
        cut = out < kth
        out = out.masked_fill(cut, float("-inf"))
        if not unlimited.any() and int((~cut).sum(-1).max()) <= k_max:  # no tie past k_max
            ranked, order = top.masked_fill(top < kth, float("-inf")), top_ids
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        whole = len(nucleus) == rows
        index = None if whole else torch.tensor(nucleus, device=logits.device)
        part = out if whole else out.index_select(0, index)  # (n, vocab)
        top_p = torch.tensor([params[i].top_p for i in nucleus], device=logits.device)
        if ranked is not None:  # the survivors, already ranked by top-k
            if not whole:
                ranked, order = ranked.index_select(0, index), order.index_select(0, index)
        elif all(ks[i] for i in nucleus):  # only the finite tokens can be kept
            width = int(torch.isfinite(part).sum(-1).max())
            ranked, order = torch.topk(part, width, dim=-1)  # (n, width) descending
        else:
            ranked, order = torch.sort(part, dim=-1, descending=True)  # (n, vocab)
        probs = ranked.softmax(-1)  # (n, width): the -inf past a row's survivors add 0
        before = probs.cumsum(-1) - probs  # mass strictly before each token
        keep = torch.zeros_like(part, dtype=torch.bool)
        keep.scatter_(1, order, before < top_p[:, None])
        part = part.masked_fill(~keep, float("-inf"))
        if whole:
            out = part
        else:
            out[index] = part
    return out


def _min_p(out: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Drop tokens below ``min_p`` x the top probability, on the rows that set min_p."""
    rows = [i for i, p in enumerate(params) if p.min_p]  # ``out`` is the temperature's copy
    index = torch.tensor(rows, device=out.device)
    part = out.index_select(0, index)  # (n, vocab)
    probs = part.softmax(-1)
    min_p = torch.tensor([params[i].min_p for i in rows], device=out.device)[:, None]
    cut = probs < min_p * probs.max(-1, keepdim=True).values
    out[index] = part.masked_fill(cut, float("-inf"))
    return out


def sample(
    logits: torch.Tensor,  # (num_rows, vocab)
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> torch.Tensor:
    hot = [row for row, p in enumerate(params) if not p.is_greedy]
    if not hot:
        return logits.argmax(-1)  # (num_rows,)
    whole = len(hot) == len(params)
    index = torch.tensor(hot, device=logits.device)
    chosen = logits if whole else logits.index_select(0, index)
    probs = filter_rows(chosen.float(), [params[r] for r in hot]).softmax(-1)  # (hot, vocab)
    noise = torch.empty_like(probs)
    for j, row in enumerate(hot):  # each row's own (seed, position) stream
        gen = torch.Generator(device=logits.device)
        gen.manual_seed(position_seed(seeds[row], positions[row]))
        noise[j].exponential_(generator=gen)
    drawn = (probs / noise).argmax(-1)
    if whole:
        return drawn
    tokens = logits.argmax(-1)  # greedy rows; the sampled ones overwritten
    tokens[index] = drawn
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
