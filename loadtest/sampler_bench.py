"""The sampler's step time at batch 64, before and after batching (issue 25).

"Before" is the one-row recipe the engine used until the batched sampler: per sampled row,
temperature, top-k, a full-vocabulary sort for top-p, softmax and the seeded draw (the
row's own noise: ``race_noise`` of its one key). "After" is
``tokenrouter_ray.engine.sampler.sample``: the filters and the noise of every row at once.
Both draw the same tokens (checked here and in tests/engine/test_sampling_batched.py),
which is also the check that a row's noise does not depend on its batch. Prints one line
per setting with both medians; speed is reported, never asserted.

    python -m loadtest.sampler_bench [--batch 64] [--vocab 151936] [--device cpu]
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence

import torch

from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.sampler import position_seed, race_noise, sample


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


def median_ms(fn, args: tuple, repeat: int, sync) -> float:
    times = []
    for _ in range(repeat):
        sync()
        t0 = time.perf_counter()
        fn(*args)
        sync()
        times.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(times)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--vocab", type=int, default=151936)  # Qwen3's
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args(argv)
    dev = torch.device(args.device)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    gen = torch.Generator().manual_seed(0)
    logits = (torch.randn(args.batch, args.vocab, generator=gen) * 4).to(dev)
    seeds = list(range(args.batch))
    positions = [100 + i for i in range(args.batch)]
    print(f"sampler, batch {args.batch}, vocab {args.vocab}, {args.device}: median ms per step")
    for name, p in SETTINGS.items():
        params = [p] * args.batch
        same = torch.equal(sample_per_row(logits, params, seeds, positions),
                           sample(logits, params, seeds, positions))  # fmt: skip
        call = (logits, params, seeds, positions)
        before = median_ms(sample_per_row, call, args.repeat, sync)
        after = median_ms(sample, call, args.repeat, sync)
        print(f"  {name:28} before {before:8.2f}  after {after:8.2f}  "
              f"({before / after:4.1f}x)  same tokens: {same}")  # fmt: skip
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
