"""Logits processors that may change even a greedy choice: logit_bias, min_tokens, penalties.

Raw next-token logits enter as (num_rows, vocab) floats with, per row, the request's
`SamplingParams`, its whole committed sequence (prompt + output token ids, as this model
holds it: after a handoff the receiving model holds every token, whoever wrote it) and its
prompt length. The processed logits leave as a new tensor (the raw one is left as it was:
routing policies and logprobs read raw logits). Rows whose params use no processor pass
through untouched, and a batch where no row uses one costs nothing (the input is returned).

The order is vLLM v1's (its sampler): first the processors that are not argmax-invariant
(``logit_bias`` added, then ``min_tokens``: EOS and ``stop_token_ids`` set to -inf while
fewer than ``min_tokens`` output tokens exist), then the penalties:

- ``repetition_penalty`` p over every token id in the prompt or the output: a positive
  logit is divided by p, a negative one multiplied by it (transformers' arithmetic);
- ``frequency_penalty`` f and ``presence_penalty`` r over the output only (OpenAI's
  definition): ``logit - f * count - r * (count > 0)``.

Then the sampler: greedy argmax, or temperature → min_p → top-k → top-p
(`sampler.filter_rows`).

Batched: one kernel per processor for the rows that use it; the penalties count tokens
with one bincount over the flattened (row, token id) pairs of those rows, on the logits'
device (an ``index_add`` of ones; no loop over the vocabulary; host work is copying each
such row's ids once). Every per-row value is built on the host and staged once
(``device_step.to_device``: pinned, non-blocking on CUDA) and every decision is taken from
the params, so nothing here waits for the forward queued before it.
"""

from __future__ import annotations

from collections.abc import Collection, Sequence
from itertools import chain

import torch

from tokenrouter_ray.engine.device_step import to_device
from tokenrouter_ray.engine.request import SamplingParams


def uses_processors(params: Sequence[SamplingParams]) -> bool:
    """Whether any row needs `apply_processors` (else skip the call)."""
    return any(p.has_processors for p in params)


def apply_processors(
    logits: torch.Tensor,  # (num_rows, vocab) raw
    params: Sequence[SamplingParams],
    sequences: Sequence[Sequence[int]],  # each row's committed prompt + output ids
    num_prompt_tokens: Sequence[int],
    eos_token_ids: Collection[int],
) -> torch.Tensor:
    """The processed logits, (num_rows, vocab) float32; ``logits`` itself when no row uses
    a processor."""
    hot = [i for i, p in enumerate(params) if p.has_processors]
    if not hot:
        return logits
    dev = logits.device
    whole = len(hot) == logits.shape[0]
    index = None if whole else to_device(hot, torch.long, dev)  # (n,)
    part = (logits if whole else logits.index_select(0, index)).float().clone()  # (n, vocab)
    hot_params = [params[i] for i in hot]
    _add_bias(part, hot_params)
    num_output = [len(sequences[i]) - num_prompt_tokens[i] for i in hot]
    _mask_early_stops(part, hot_params, num_output, eos_token_ids)
    _penalize(part, hot_params, [sequences[i] for i in hot], [num_prompt_tokens[i] for i in hot])
    if whole:
        return part
    out = logits.float().clone()
    out[index] = part
    return out


def _add_bias(part: torch.Tensor, params: Sequence[SamplingParams]) -> None:
    pairs = [(j, t, b) for j, p in enumerate(params) for t, b in p.logit_bias]
    if not pairs:
        return
    vocab = part.shape[1]
    pairs = [(j, t, b) for j, t, b in pairs if t < vocab]  # the ingress refuses others
    dev = part.device
    row = to_device([j for j, _, _ in pairs], torch.long, dev)  # (num_pairs,)
    tok = to_device([t for _, t, _ in pairs], torch.long, dev)
    bias = to_device([b for _, _, b in pairs], part.dtype, dev)
    part.index_put_((row, tok), bias, accumulate=True)  # (row, token) pairs are distinct


def _mask_early_stops(
    part: torch.Tensor,
    params: Sequence[SamplingParams],
    num_output: Sequence[int],
    eos_token_ids: Collection[int],
) -> None:
    """Rows with fewer than ``min_tokens`` outputs cannot sample EOS or a stop token id
    (vLLM masks EOS even with ``ignore_eos``, where it would not stop anyway)."""
    vocab = part.shape[1]
    eos = sorted(t for t in eos_token_ids if t < vocab)
    cells = [
        (j, t)
        for j, p in enumerate(params)
        if num_output[j] < p.min_tokens
        for t in sorted(set(eos).union(t for t in p.stop_token_ids if t < vocab))
    ]
    if not cells:
        return
    row = to_device([j for j, _ in cells], torch.long, part.device)  # (num_cells,)
    tok = to_device([t for _, t in cells], torch.long, part.device)
    part.index_put_((row, tok), part.new_full((), float("-inf")))  # a fill, not a copy


def _penalize(
    part: torch.Tensor,
    params: Sequence[SamplingParams],
    sequences: Sequence[Sequence[int]],
    num_prompt: Sequence[int],
) -> None:
    rows = [
        j
        for j, p in enumerate(params)
        if p.repetition_penalty != 1.0 or p.frequency_penalty or p.presence_penalty
    ]
    if not rows:
        return
    m, vocab = len(rows), part.shape[1]
    dev = part.device
    sub = to_device(rows, torch.long, dev)  # (m,)
    # Each row's output ids and prompt ids, flattened to row * vocab + id: one bincount.
    outputs = [sequences[j][num_prompt[j] :] for j in rows]
    prompts = [sequences[j][: num_prompt[j]] for j in rows]
    out_counts = _bincount(outputs, m, vocab, dev)  # (m, vocab) occurrences in the output
    logits = part.index_select(0, sub)  # (m, vocab)
    if any(params[j].repetition_penalty != 1.0 for j in rows):  # decided on the host
        rep = to_device([params[j].repetition_penalty for j in rows], torch.float32, dev)[:, None]
        seen = (out_counts > 0) | (_bincount(prompts, m, vocab, dev) > 0)
        penalty = torch.where(seen, rep, torch.ones_like(rep))  # (m, vocab)
        logits = torch.where(logits > 0, logits / penalty, logits * penalty)
    if any(params[j].frequency_penalty or params[j].presence_penalty for j in rows):
        freq = to_device([params[j].frequency_penalty for j in rows], torch.float32, dev)
        pres = to_device([params[j].presence_penalty for j in rows], torch.float32, dev)
        logits = logits - freq[:, None] * out_counts  # (m, vocab)
        logits = logits - pres[:, None] * (out_counts > 0)
    part[sub] = logits


def _bincount(
    seqs: Sequence[Sequence[int]], m: int, vocab: int, device: torch.device
) -> torch.Tensor:
    """(m, vocab) float32 counts of each row's token ids (ids outside the vocabulary are
    never committed: the engine checks every id it takes)."""
    lengths = [len(s) for s in seqs]
    ids = to_device(list(chain.from_iterable(seqs)), torch.long, device)  # (sum(lengths),)
    rows = torch.repeat_interleave(  # (sum(lengths),): each id's row; the size known here
        torch.arange(m, device=device),
        to_device(lengths, torch.long, device),
        output_size=sum(lengths),
    )
    counts = torch.zeros(m * vocab, dtype=torch.float32, device=device)
    counts.index_add_(0, rows * vocab + ids, torch.ones_like(ids, dtype=torch.float32))
    return counts.view(m, vocab)
