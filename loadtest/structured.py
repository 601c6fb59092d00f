"""What a structured-output grammar costs (issue 28): LocalRuntime on the demo pair under
R2R with its trained router, N concurrent greedy requests, with and without a JSON-schema
grammar (every model masks its logits with it; docs/reference/api.md, "Structured outputs").

Rounds alternate between the modes so that load from other processes hits them alike:

- ``off``: no grammar (``ignore_eos``: exactly ``--tokens`` tokens each);
- ``json``: a JSON schema (an answer string and up to 8 step strings), ``max_tokens`` the
  same; a request ends when its JSON is complete, so counts differ a little per request.

Each round reports output tokens per wall second and the host CPU time per constrained
token spent in ``GrammarBook.mask_rows`` (sync the matchers, fill the bitmask, apply it),
measured with the thread's CPU clock: that figure is precise where wall time on a shared
machine is not. Every ``json`` output is checked to parse and validate against the schema.

    python -m loadtest --preset structured [--concurrency 8] [--tokens 64] [--rounds 3]
    python -m loadtest.structured ...   # the same
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import jsonschema
import msgspec

from loadtest.common import chat_prompts, command, demo_pair, demo_r2r_policy, machine
from tokenrouter_ray.engine.engine import Engine
from tokenrouter_ray.engine.grammar import GrammarBook
from tokenrouter_ray.engine.request import GrammarSpec
from tokenrouter_ray.local import LocalRuntime
from tokenrouter_ray.protocol import SamplingSpec

SCHEMA = {
    "type": "object",
    "properties": {
        "answer": {"type": "string", "maxLength": 300},
        "steps": {"type": "array", "items": {"type": "string", "maxLength": 80}, "maxItems": 8},
    },
    "required": ["answer", "steps"],
}
mask_cpu = [0.0]  # seconds in GrammarBook.mask_rows


def time_masks() -> None:
    method = GrammarBook.mask_rows

    def timed(self, *args, **kwargs):
        t0 = time.thread_time()
        try:
            return method(self, *args, **kwargs)
        finally:
            mask_cpu[0] += time.thread_time() - t0

    GrammarBook.mask_rows = timed


async def run_rounds(
    engines: list[Engine], prompts: list[list[int]], tokens: int, rounds: int, tokenizer
) -> dict[str, list[tuple[float, float, float]]]:
    policy = demo_r2r_policy()
    modes = {
        "off": SamplingSpec(temperature=0.0, max_tokens=tokens, seed=7, ignore_eos=True),
        "json": SamplingSpec(
            temperature=0.0,
            max_tokens=tokens,
            seed=7,
            grammar=GrammarSpec("json_schema", json.dumps(SCHEMA)),
        ),
    }
    results: dict[str, list[tuple[float, float, float]]] = {m: [] for m in modes}
    async with LocalRuntime([("small", engines[0]), ("large", engines[1])], policy) as rt:
        for spec in modes.values():
            await rt.complete_all(prompts, msgspec.structs.replace(spec, max_tokens=8))  # warm
        for r in range(rounds):
            for mode in list(modes) if r % 2 == 0 else list(modes)[::-1]:
                wall, mask_cpu[0] = time.perf_counter(), 0.0
                done = await rt.complete_all(prompts, modes[mode])
                wall = time.perf_counter() - wall
                n = sum(len(d.token_ids) for d in done)
                valid = 0
                if mode == "json":
                    for d in done:
                        if d.finish_reason == "stop":
                            text = tokenizer.decode(d.token_ids, skip_special_tokens=True)
                            jsonschema.validate(json.loads(text), SCHEMA)
                            valid += 1
                mask_us = 1e6 * mask_cpu[0] / n
                handoffs = sum(d.handoffs for d in done)
                results[mode].append((n / wall, mask_us, n / len(done)))
                print(
                    f"round {r} {mode:>4}: {n / wall:7.1f} tok/s  {n / len(done):5.1f} tok/req  "
                    f"mask {mask_us:6.1f} us/tok  handoffs {handoffs}  "
                    + (f"valid {valid}/{len(done)} (rest: length)  " if mode == "json" else "")
                    + f"load {os.getloadavg()[0]:.2f}",
                    flush=True,
                )
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--concurrency", type=int, default=8)
    parser.add_argument("--tokens", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    engines, tokenizer, label = demo_pair()
    prompts = chat_prompts(tokenizer, args.concurrency)
    start_load = os.getloadavg()
    time_masks()
    results = asyncio.run(run_rounds(engines, prompts, args.tokens, args.rounds, tokenizer))
    print(
        f"\nMachine: {machine()}\nPair: SmolLM2-135M-Instruct (large) + {label} (small); R2R "
        f"with the demo router; N={args.concurrency}, up to {args.tokens} tokens per request, "
        f"{args.rounds} rounds per mode, alternating\nLoad average: start "
        f"{start_load[0]:.2f}, end {os.getloadavg()[0]:.2f}\nCommand: {command()}\n"
    )
    off = statistics.median(r[0] for r in results["off"])
    print("| mode | median tok/s | vs off | mask CPU µs / tok | tokens / request |")
    print("|---|---|---|---|---|")
    for mode, rows in results.items():
        tps = statistics.median(r[0] for r in rows)
        mask = statistics.median(r[1] for r in rows)
        per = statistics.median(r[2] for r in rows)
        print(f"| {mode} | {tps:.1f} | {tps / off:.2f} | {mask:.1f} | {per:.1f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
