"""The demo pair: held-out greedy agreement of the small model with the large one, and the
decode step time of both through our Engine at batch 1 and 8.

Agreement is measured afresh, the way the build measures it: the large model answers the
held-out prompts (topics never seen in training) greedily, and the small model, teacher-
forced on prompt + answer, predicts each answer token. Step times are the median decode
step of each run, the best of ``--repeats`` runs, large and small interleaved so that
background load hits both alike.

    python -m loadtest.demo_pair_bench [--steps 24] [--repeats 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import time

import torch
from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

from loadtest.common import command, machine
from tokenrouter_ray.demo import prepare_demo
from tokenrouter_ray.demo.small import (
    Recipe,
    agreement,
    encode_chat,
    prepare_small_model,
    read_build_info,
    teacher_samples,
)
from tokenrouter_ray.engine.config import EngineConfig
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.request import SamplingParams
from tokenrouter_ray.engine.scheduler import SchedulerConfig


def decode_step_ms(engine: Engine, prompts: list[list[int]], steps: int) -> float:
    """Median wall time of one decode step with ``len(prompts)`` requests running."""
    for i, p in enumerate(prompts):
        rid = f"b{len(prompts)}-{i}-{time.monotonic_ns()}"
        engine.add_request(rid, p, SamplingParams(max_tokens=steps + 1, ignore_eos=True))
    engine.step()  # prefill
    times = []
    while engine.has_unfinished:
        t0 = time.perf_counter()
        engine.step()
        times.append(time.perf_counter() - t0)
    return 1e3 * statistics.median(times)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=24, help="decode steps per timing run")
    parser.add_argument("--repeats", type=int, default=5, help="timing runs per model and batch")
    args = parser.parse_args()
    torch.manual_seed(0)

    large_dir = prepare_demo(quiet=True)
    small_dir = prepare_small_model(large_dir, quiet=True)
    info = read_build_info(small_dir) or {}
    recipe = Recipe(**info["recipe"]) if "recipe" in info else Recipe()
    tokenizer = AutoTokenizer.from_pretrained(small_dir)
    heldout = [encode_chat(tokenizer, p) for p in info.get("heldout_prompts", [])]

    def engine(path: object, **kw: object) -> Engine:
        return Engine.from_config(
            EngineConfig(model=str(path), memory_budget_bytes=2**30, **kw)  # type: ignore[arg-type]
        )

    # Agreement on the held-out prompts the build recorded.
    teacher = engine(large_dir, keep_logits=True, scheduler=SchedulerConfig(max_num_seqs=128))
    t0 = time.perf_counter()
    answers = teacher_samples(teacher, heldout, recipe.max_tokens, top_k=1)
    del teacher
    small_hf = AutoModelForCausalLM.from_pretrained(small_dir, dtype=torch.float32).eval()
    stats = agreement(small_hf, answers)
    agree_s = time.perf_counter() - t0
    del small_hf
    gc.collect()

    # Step times, interleaved.
    engines = {"large": engine(large_dir), "small": engine(small_dir)}
    prompts = heldout[:8]
    best: dict[tuple[str, int], float] = {}
    for _ in range(args.repeats):
        for batch in (1, 8):
            for name, eng in engines.items():
                ms = decode_step_ms(eng, prompts[:batch], args.steps)
                best[name, batch] = min(best.get((name, batch), float("inf")), ms)

    small_layers = AutoConfig.from_pretrained(small_dir).num_hidden_layers
    large_layers = AutoConfig.from_pretrained(large_dir).num_hidden_layers
    print(f"\nMachine: {machine()}, torch threads {torch.get_num_threads()}")
    print(f"Large: {large_dir} ({large_layers} layers)")
    print(
        f"Small: {small_dir} ({small_layers} layers: {recipe.exit_layer} copied + "
        f"{recipe.extra_layers} distilled; built in {info.get('build_seconds', '?')} s)\n"
    )
    print(
        f"Held-out greedy agreement: {stats['agreement']:.1%} on {stats['tokens']} tokens of "
        f"{len(heldout)} held-out prompts ({agree_s:.0f} s to measure; recorded at build: "
        f"{info.get('heldout', {}).get('agreement', float('nan')):.1%})"
    )
    print(
        f"Small model's normalized entropy: {stats['entropy_when_agreeing']:.3f} where it "
        f"agrees, {stats['entropy_when_disagreeing']:.3f} where it does not\n"
    )
    print("| batch | large step (ms) | small step (ms) | small / large |")
    print("|---:|---:|---:|---:|")
    for batch in (1, 8):
        lg, sm = best["large", batch], best["small", batch]
        print(f"| {batch} | {lg:.1f} | {sm:.1f} | {sm / lg:.0%} |")
    print(f"\nReproduce: {command()}")


if __name__ == "__main__":
    main()
