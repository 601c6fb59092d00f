"""Engine throughput on the demo model vs. plain ``model.generate`` one request at a time.

Prints a markdown table: decode throughput at batch 1, 4 and 16, a mixed prefill+decode
load with staggered arrivals, the sequential baseline, and the share of each step spent
outside the model forward (scheduler, input preparation, sampling, commit).

    python -m loadtest.engine_bench [--tokens 32] [--mixed 16]
"""

from __future__ import annotations

import argparse
import random
import statistics
import time

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from loadtest.common import chat_prompts, command, machine
from tokenrouter_ray.demo import prepare_demo
from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.outputs import StepTimings
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.scheduler import SchedulerConfig


def sequential_generate(model, prompts: list[list[int]], tokens: list[int]) -> float:
    """Seconds for model.generate over the prompts one at a time (greedy, fixed lengths)."""
    t0 = time.perf_counter()
    with torch.inference_mode():
        for p, n in zip(prompts, tokens, strict=True):
            model.generate(torch.tensor([p]), do_sample=False, max_new_tokens=n, min_new_tokens=n)
    return time.perf_counter() - t0


def decode_throughput(engine: Engine, prompts: list[list[int]], n: int) -> tuple[float, float]:
    """Decode tokens/s after a joint prefill, and the overhead share of a step."""
    for i, p in enumerate(prompts):
        engine.add_request(f"d{len(prompts)}-{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
    engine.step()  # prefill all
    timings: list[StepTimings] = []
    tokens = 0
    t0 = time.perf_counter()
    while engine.has_unfinished:
        result = engine.execute()
        tokens += len(engine.commit(result))
        timings.append(result.timings)
    elapsed = time.perf_counter() - t0
    overhead = statistics.fmean(t.overhead / t.total for t in timings)
    return tokens / elapsed, overhead


def mixed_load(
    engine: Engine, prompts: list[list[int]], outs: list[int]
) -> tuple[float, float, int]:
    """Requests arrive two per step while earlier ones decode: prefills mix with decodes."""
    pending = list(enumerate(zip(prompts, outs, strict=True)))
    timings: list[StepTimings] = []
    tokens = 0
    mixed_steps = 0
    t0 = time.perf_counter()
    while pending or engine.has_unfinished:
        for _ in range(min(2, len(pending))):
            i, (p, n) = pending.pop(0)
            engine.add_request(f"m{i}", p, SamplingParams(max_tokens=n, ignore_eos=True))
        result = engine.execute()
        if result is None:
            continue
        tokens += sum(len(o.new_token_ids) for o in engine.commit(result))
        timings.append(result.timings)
        mixed_steps += result.num_scheduled_tokens > result.batch_size
    elapsed = time.perf_counter() - t0
    return tokens / elapsed, statistics.fmean(t.overhead / t.total for t in timings), mixed_steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tokens", type=int, default=32, help="output tokens per request")
    parser.add_argument("--mixed", type=int, default=16, help="requests in the mixed load")
    parser.add_argument("--baseline", type=int, default=4, help="requests for the baseline")
    args = parser.parse_args()
    torch.manual_seed(0)

    path = str(prepare_demo(quiet=True))
    tokenizer = AutoTokenizer.from_pretrained(path)
    model = AutoModelForCausalLM.from_pretrained(path).eval()
    engine = Engine.from_config(
        EngineConfig(
            model=path,
            memory_budget_bytes=3 * 2**30,
            scheduler=SchedulerConfig(max_num_seqs=16, max_num_batched_tokens=512),
        )
    )
    prompts = chat_prompts(tokenizer, 16)
    rng = random.Random(0)

    seq_s = sequential_generate(model, prompts[: args.baseline], [args.tokens] * args.baseline)
    seq_tps = args.baseline * args.tokens / seq_s
    rows = [("model.generate, one request at a time", seq_tps, 1.0, float("nan"))]
    for batch in (1, 4, 16):
        tps, overhead = decode_throughput(engine, prompts[:batch], args.tokens)
        rows.append((f"engine decode, batch {batch}", tps, tps / seq_tps, overhead))

    # Mixed: varied prompt lengths (chat prompts padded with a random prefix) and outputs.
    mixed_prompts = [
        [rng.randrange(100, 20000) for _ in range(rng.randint(0, 200))] + prompts[i % 16]
        for i in range(args.mixed)
    ]
    mixed_outs = [rng.randint(args.tokens // 2, args.tokens * 2) for _ in range(args.mixed)]
    tps, overhead, mixed_steps = mixed_load(engine, mixed_prompts, mixed_outs)
    seq_mixed = sum(mixed_outs[:4]) / sequential_generate(model, mixed_prompts[:4], mixed_outs[:4])
    rows.append(("model.generate on the mixed prompts", seq_mixed, 1.0, float("nan")))
    rows.append(
        (
            f"engine mixed load ({args.mixed} requests, {mixed_steps} mixed steps)",
            tps,
            tps / seq_mixed,
            overhead,
        )
    )

    print(
        f"\nMachine: {machine()}\nDemo model: SmolLM2-135M-Instruct fp32, {args.tokens} "
        f"output tokens per request (mixed: {min(mixed_outs)}-{max(mixed_outs)})\n"
    )
    print("| load | tokens/s | vs sequential | overhead share of a step |")
    print("|---|---:|---:|---:|")
    for name, value, ratio, over in rows:
        share = "–" if over != over else f"{over:.1%}"
        print(f"| {name} | {value:.1f} | {ratio:.2f}× | {share} |")
    print(f"\nReproduce: {command()}")


if __name__ == "__main__":
    main()
