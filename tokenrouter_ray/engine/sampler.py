"""Next-token sampling: greedy, temperature, min-p, top-k, top-p, with per-request seeds.

A request's random draw at a position depends only on (its seed, that position), never on
the batch it shares: a sampled row draws by the exponential race (``argmax(p / E)``,
``E ~ Exp(1)``), which samples exactly from ``p`` with one vector of noise, and that noise
is a counter-based stream (``race_noise``): token ``j``'s draw is splitmix64's ``j + 1``-th
output from the row's key ``position_seed(seed, position)``, computed for every sampled row
at once by integer tensor ops. No ``torch.Generator``, no per-row kernel, no state: the
same (seed, position) gives the same noise alone or in any batch (and the same integer
stream on any device; only the float64 ``log`` may round differently). Logits
enter as (num_rows, vocab) float tensors; token ids leave as a (num_rows,) long tensor on
the same device.

Nothing here reads the device: every per-row value (indices, k, p, min-p, noise keys) is
built on the host from the rows' ``SamplingParams`` and staged once
(``device_step.to_device``: pinned, non-blocking on CUDA), and every branch is decided from
those host lists, so on CUDA the whole sampler is queued behind the forward without
waiting for it. Asked logprobs are
queued the same way (``queue_logprobs``) and read back with the tokens (``LogprobRows``).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch

from tokenrouter_ray.engine.device_step import host_buffer, to_device
from tokenrouter_ray.engine.outputs import TokenLogprobs
from tokenrouter_ray.engine.request import SamplingParams

_MIX = 0x9E3779B97F4A7C15  # golden-ratio constant: spreads (seed, position) over 63 bits
_MUL1, _MUL2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB  # splitmix64's finaliser


def position_seed(seed: int, position: int) -> int:
    """The key of a row's noise stream at ``position`` (63 bits)."""
    return (seed * _MIX + position * 0xBF58476D1CE4E5B9 + 1) % (2**63 - 1)


def _signed(value: int) -> int:
    """A 64-bit pattern as the int64 torch stores (two's complement)."""
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(z: torch.Tensor, shift: int, out: torch.Tensor) -> torch.Tensor:
    """``out = z >>> shift``: a logical shift of int64 bit patterns (torch's ``>>`` is
    arithmetic: the sign bits shifted in are masked off)."""
    torch.bitwise_right_shift(z, shift, out=out)
    return out.bitwise_and_((1 << (64 - shift)) - 1)


NOISE_CHUNK_ELEMENTS = 1 << 23  # race_noise's working set per pass: 3 x 64 MiB temporaries


def race_noise(keys: torch.Tensor, vocab: int) -> torch.Tensor:
    """(rows, vocab) float32 Exp(1) noise, row ``i`` a pure function of ``keys[i]``
    ((rows,) int64, ``position_seed``): splitmix64 (state ``key + (j + 1) * golden``,
    its finaliser, wrapping int64 arithmetic), the top 52 bits as ``u`` in (0, 1) (never
    0 or 1), ``E = -log(u)`` in float64, then float32 (never 0: a dropped token's
    ``0 / E`` stays 0). Rows go in passes of at most ``NOISE_CHUNK_ELEMENTS`` draws, so
    the int64 and float64 temporaries stay bounded at any batch size."""
    rows = keys.shape[0]
    out = torch.empty(rows, vocab, dtype=torch.float32, device=keys.device)  # (rows, vocab)
    counter = torch.arange(1, vocab + 1, dtype=torch.int64, device=keys.device)  # (vocab,)
    counter.mul_(_signed(_MIX))  # (j + 1) * golden, mod 2**64
    step = max(1, NOISE_CHUNK_ELEMENTS // max(vocab, 1))
    for first in range(0, rows, step):  # decided on the host: no read of ``keys``
        part = keys[first : first + step]  # (n,)
        z = part[:, None] + counter[None, :]  # (n, vocab) int64: the generator's states
        t = torch.empty_like(z)
        z.bitwise_xor_(_shift_right(z, 30, t)).mul_(_signed(_MUL1))
        z.bitwise_xor_(_shift_right(z, 27, t)).mul_(_signed(_MUL2))
        z.bitwise_xor_(_shift_right(z, 31, t))
        top = _shift_right(z, 12, t)  # (n, vocab): 52 random bits, < 2**52
        del z
        u = top.to(torch.float64).add_(0.5).mul_(2.0**-52)  # exact: (k + 0.5) / 2**52
        out[first : first + step] = u.log_().neg_()
    return out


def filter_logits(logits: torch.Tensor, params: SamplingParams) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p, on one row of (vocab,) float logits."""
    return filter_rows(logits[None], [params])[0]


def filter_rows(logits: torch.Tensor, params: Sequence[SamplingParams]) -> torch.Tensor:
    """Temperature, then min-p, top-k and top-p (vLLM's order), on (num_rows, vocab) float
    logits, one ``SamplingParams`` per row, batched: a handful of kernels for the whole
    batch, never a loop of full-vocabulary sorts, and no read of the device (every
    decision is taken from ``params``). The arithmetic per row is the one-row recipe's:

    - temperature: each distinct temperature divides its rows by the same Python scalar;
    - min-p (only when some row sets it): a token whose probability after temperature is
      below ``min_p`` times the row's largest is dropped;
    - top-k: one ``topk`` at the largest k; a row's k-th largest value is its threshold
      (ties with it are kept);
    - top-p (only on the rows that set it): one batched descending sort of those rows (a
      top-k of the survivors would need their count, a device read); the kept set is the
      shortest sorted prefix whose mass reaches p (the token crossing p is kept).
    """
    rows, vocab = logits.shape
    dev = logits.device
    temps = [p.temperature for p in params]
    if len(set(temps)) == 1:
        out = logits / temps[0]
    else:
        out = torch.empty_like(logits)
        for t in sorted(set(temps)):
            index = to_device([i for i, v in enumerate(temps) if v == t], torch.long, dev)
            out[index] = logits.index_select(0, index) / t
    if any(p.min_p for p in params):
        out = _min_p(out, params)
    ks = [p.top_k if p.top_k and p.top_k < vocab else 0 for p in params]
    if any(ks):
        top = torch.topk(out, max(ks), dim=-1).values  # (rows, k_max), descending
        k_index = to_device([max(k, 1) - 1 for k in ks], torch.long, dev)  # (rows,)
        kth = top.gather(1, k_index[:, None])  # (rows, 1)
        if not all(ks):  # rows without top-k keep everything
            unlimited = to_device([k == 0 for k in ks], torch.bool, dev)[:, None]
            kth = kth.masked_fill(unlimited, float("-inf"))
        out = out.masked_fill(out < kth, float("-inf"))
    nucleus = [i for i, p in enumerate(params) if p.top_p < 1.0]
    if nucleus:
        whole = len(nucleus) == rows
        index = None if whole else to_device(nucleus, torch.long, dev)  # (n,)
        part = out if whole else out.index_select(0, index)  # (n, vocab)
        top_p = to_device([params[i].top_p for i in nucleus], torch.float32, dev)  # (n,)
        ranked, order = torch.sort(part, dim=-1, descending=True)  # (n, vocab)
        probs = ranked.softmax(-1)  # (n, vocab): the -inf past a row's survivors add 0
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
    index = to_device(rows, torch.long, out.device)  # (n,)
    part = out.index_select(0, index)  # (n, vocab)
    probs = part.softmax(-1)
    min_p = to_device([params[i].min_p for i in rows], torch.float32, out.device)[:, None]
    cut = probs < min_p * probs.max(-1, keepdim=True).values
    out[index] = part.masked_fill(cut, float("-inf"))
    return out


def sample(
    logits: torch.Tensor,  # (num_rows, vocab)
    params: Sequence[SamplingParams],
    seeds: Sequence[int],
    positions: Sequence[int],
) -> torch.Tensor:
    """One token per row, (num_rows,) long on the logits' device: argmax for greedy rows,
    the exponential race over the filtered distribution for the others, with each row's
    noise ``race_noise`` of ``position_seed(seed, position)`` (keys built on the host,
    staged once)."""
    hot = [row for row, p in enumerate(params) if not p.is_greedy]
    if not hot:
        return logits.argmax(-1)  # (num_rows,)
    whole = len(hot) == len(params)
    index = None if whole else to_device(hot, torch.long, logits.device)  # (hot,)
    chosen = logits if whole else logits.index_select(0, index)
    probs = filter_rows(chosen.float(), [params[r] for r in hot]).softmax(-1)  # (hot, vocab)
    keys = [position_seed(seeds[r], positions[r]) for r in hot]  # the host's, staged once
    noise = race_noise(to_device(keys, torch.long, logits.device), probs.shape[1])
    drawn = probs.div_(noise).argmax(-1)  # (hot,)
    if whole:
        return drawn
    tokens = logits.argmax(-1)  # greedy rows; the sampled ones overwritten
    tokens[index] = drawn
    return tokens


@dataclass
class LogprobRows:
    """The asked rows' logprobs, queued on the device (``queue_logprobs``); ``to_host``
    queues their copy back (non-blocking into pinned memory on CUDA), ``read`` gives the
    per-row tuples once the step is done."""

    top: list[int | None]  # per row: None (not asked) or how many alternatives
    rows: list[int]  # the asked rows
    chosen: torch.Tensor  # (n,) float32: the sampled token's logprob
    ids: torch.Tensor | None  # (n, k_max) long, descending; None when no row asked for any
    values: torch.Tensor | None  # (n, k_max) float32

    def to_host(self) -> LogprobRows:
        def back(t: torch.Tensor | None) -> torch.Tensor | None:
            if t is None or t.device.type == "cpu":
                return t
            buf = host_buffer(tuple(t.shape), t.dtype, t.device)  # pragma: no cover - CUDA
            return buf.copy_(t, non_blocking=True)  # pragma: no cover - needs CUDA

        chosen, ids, values = back(self.chosen), back(self.ids), back(self.values)
        return LogprobRows(self.top, self.rows, chosen, ids, values)

    def read(self) -> list[TokenLogprobs | None]:
        out: list[TokenLogprobs | None] = [None] * len(self.top)
        chosen = self.chosen.tolist()
        ids = self.ids.tolist() if self.ids is not None else [[] for _ in self.rows]
        values = self.values.tolist() if self.values is not None else [[] for _ in self.rows]
        for j, i in enumerate(self.rows):
            k = self.top[i]
            out[i] = (chosen[j], ids[j][:k], values[j][:k])
        return out


def queue_logprobs(
    logits: torch.Tensor,  # (num_rows, vocab)
    tokens: torch.Tensor,  # (num_rows,) the sampled ids
    top: Sequence[int | None],  # per row: None (not asked) or how many alternatives
) -> LogprobRows | None:
    """log_softmax of the raw logits at each asked row, on the device (None: no row
    asked): the sampled token's and the ``top[row]`` largest, descending."""
    rows = [i for i, k in enumerate(top) if k is not None]
    if not rows:
        return None
    index = to_device(rows, torch.long, logits.device)  # (n,)
    logp = torch.log_softmax(logits.index_select(0, index).float(), dim=-1)  # (n, vocab)
    chosen = logp.gather(1, tokens.index_select(0, index)[:, None])[:, 0]  # (n,)
    k_max = max(top[i] for i in rows)
    ids = values = None
    if k_max:
        best = torch.topk(logp, k_max, dim=-1)  # (n, k_max)
        ids, values = best.indices, best.values
    return LogprobRows(list(top), rows, chosen, ids, values)


def token_logprobs(
    logits: torch.Tensor,  # (num_rows, vocab)
    tokens: torch.Tensor,  # (num_rows,) the sampled ids
    top: Sequence[int | None],  # per row: None (not asked) or how many alternatives
) -> list[TokenLogprobs | None]:
    """log_softmax of the raw logits (before temperature, top-k and top-p: vLLM's default
    "raw" logprobs) at each asked row: the sampled token's and the ``top[row]`` largest,
    descending. Only the asked rows are normalised and copied to the host."""
    queued = queue_logprobs(logits, tokens, top)
    return [None] * len(top) if queued is None else queued.to_host().read()
